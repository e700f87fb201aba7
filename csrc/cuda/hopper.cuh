// What graphquant's Hopper GEMMs (mixed_gemm.cu, block_gemm.cu) share: shared-memory descriptors of
// 128-byte swizzled K-major operands, wgmma's fence, commit and wait, mbarriers, TMA copies and
// their descriptors, clusters, and the output's stores. sm_90a only (wgmma, setmaxnreg).
#pragma once

#include <torch/extension.h>

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cudaTypedefs.h>

#include <cstdint>
#include <mutex>
#include <set>
#include <utility>

namespace gq {
namespace hopper {

__device__ __forceinline__ uint32_t smem_address(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// A shared-memory matrix descriptor of a K-major operand in 128-byte swizzle atoms (8 rows of 128
// bytes, 1024 bytes apart): 64 bf16 or 128 FP8 values a row.
__device__ __forceinline__ uint64_t descriptor(uint32_t address) {
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory"); }

// Registers an in-flight wgmma reads or writes stay theirs until here: the compiler may not give
// them to other values before a wait that retires it.
template <int N>
__device__ __forceinline__ void keep(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void keep(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// mbarriers and TMA copies: a producer warp fills the stages, the consumer warpgroups wait for them.
__device__ __forceinline__ void barrier_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void expect_bytes(uint32_t bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void barrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void barrier_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap& map, int inner, int outer, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(inner), "r"(outer), "r"(bar)
      : "memory");
}

// Clusters: a CTA's rank, a barrier of every thread of the cluster, and the mbarrier arrivals
// and TMA copies that reach the cluster's other CTAs (a stage one copy fills in several of them).
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// An arrival on the mbarrier at ``bar`` (this CTA's shared-memory address of it) of the cluster's
// CTA ``rank``: the default (CTA-scope) release, since what it tells (a stage's wgmmas retired) needs
// no write of this thread's made visible, and a cluster-scope release first waits for every load
// this thread has in flight.
__device__ __forceinline__ void cluster_arrive(uint32_t bar, uint32_t rank) {
  asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\nmbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
               "r"(rank)
               : "memory");
}
// tma_load into the same shared-memory offset of each CTA of the cluster in ``ctas`` (a bit a rank),
// counted on each one's mbarrier at ``bar``.
__device__ __forceinline__ void tma_multicast(uint32_t dst, const CUtensorMap& map, int inner, int outer, uint32_t bar, uint16_t ctas) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(inner), "r"(outer), "r"(bar), "h"(ctas)
      : "memory");
}

// An output's or a bias's dtype, as the kernels' arguments carry it.
enum Kind { BF16 = 0, F16 = 1, F32 = 2 };
inline int kind(at::ScalarType dtype) { return dtype == at::kBFloat16 ? BF16 : dtype == at::kHalf ? F16 : F32; }

// Element ``i`` of a bias of ``kind`` (BF16 or F16) as a float.
__device__ __forceinline__ float bias_value(const void* bias, int kind, int64_t i) {
  return kind == BF16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(bias)[i]) : __half2float(static_cast<const __half*>(bias)[i]);
}

__device__ __forceinline__ void store_value(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_value(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store_value(float* p, float v) { *p = v; }

// Opts ``kernel`` into ``bytes`` of dynamic shared memory (past 48 KiB) on the current device,
// once a device: each device's context holds a copy of the function of its own, so a kernel opted
// in on one device alone fails to launch on another.
inline void opt_in_shared_memory(const void* kernel, int bytes, const char* what) {
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> done;
  int device = 0;
  TORCH_CHECK(cudaGetDevice(&device) == cudaSuccess, what, ": no current CUDA device");
  const std::lock_guard<std::mutex> lock(mutex);
  if (done.count({kernel, device}) != 0) return;
  const cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  TORCH_CHECK(error == cudaSuccess, what, ": cannot give its kernel ", bytes, " bytes of shared memory on device ", device, " (",
              cudaGetErrorString(error), ")");
  done.insert({kernel, device});
}

// A 2-D TMA descriptor of a row-major (rows, cols) tensor of ``element`` bytes (row stride in
// bytes), copied in boxes of (box_rows, box_cols), zeros past its edges; ``what`` names the caller
// in errors.
inline CUtensorMap tensor_map(const char* what, const void* data, CUtensorMapDataType type, int element, int64_t rows, int64_t cols,
                              int64_t stride, int box_rows, int box_cols, CUtensorMapSwizzle swizzle) {
  static const auto encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    const cudaError_t error = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    TORCH_CHECK(error == cudaSuccess && found == cudaDriverEntryPointSuccess && fn != nullptr,
                "graphquant: the CUDA driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(stride)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t unit[2] = {1, 1};
  const CUresult result = encode(&map, type, 2, const_cast<void*>(data), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(result == CUDA_SUCCESS, what, ": cuTensorMapEncodeTiled failed (", static_cast<int>(result), ") for a (", rows, ", ", cols,
              ") tensor of ", element, "-byte elements, row stride ", stride, " bytes, box (", box_rows, ", ", box_cols, ")");
  return map;
}

}  // namespace hopper
}  // namespace gq
