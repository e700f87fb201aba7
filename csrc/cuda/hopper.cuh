// What graphquant's Hopper GEMMs (mixed_gemm.cu, block_gemm.cu, grouped_gemm.cu) share: shared-memory descriptors of
// 128-byte swizzled K-major operands, wgmma's fence, commit and wait, mbarriers, TMA copies and
// their descriptors, clusters, and the output's stores. sm_90a only (wgmma, setmaxnreg).
#pragma once

#include <torch/extension.h>

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <set>
#include <type_traits>
#include <utility>
#include <vector>

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

constexpr int E4M3 = 0, E5M2 = 1;  // an FP8 operand's element, as the kernels' templates take it

// One k32 wgmma of 64 rows of A by 128 rows of B, FP8 codes of elements A and B (E4M3 or E5M2),
// both K-major in shared memory: d (+)= A B^T, d's sums in the tensor cores' FP8 accumulator.
template <int A, int B>
struct Fp8Wgmma {
  __device__ static void mma(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
#define GQ_FP8_WGMMA(TYPES)                                                                                                           \
  asm volatile(                                                                                                                       \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                                                    \
      "wgmma.mma_async.sync.aligned.m64n128k32.f32." TYPES                                                                            \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, "     \
      "%26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, "     \
      "%51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"                                      \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]),         \
        "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),           \
        "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),           \
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),           \
        "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]),           \
        "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),           \
        "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])            \
      : "l"(a), "l"(b), "r"(accumulate)                                                                                               \
      : "memory")
    if constexpr (A == E4M3 && B == E4M3) GQ_FP8_WGMMA("e4m3.e4m3");
    else if constexpr (A == E4M3) GQ_FP8_WGMMA("e4m3.e5m2");
    else if constexpr (B == E4M3) GQ_FP8_WGMMA("e5m2.e4m3");
    else GQ_FP8_WGMMA("e5m2.e5m2");
#undef GQ_FP8_WGMMA
  }
};

// Tile ``tile`` of a (rows, columns) grid of tiles, walked BAND rows of tiles a column at a time,
// so that the tiles running at once share their operands in L2: its row and column.
template <int BAND>
__device__ __forceinline__ void tile_in_bands(int tile, int rows, int columns, int& row, int& column) {
  const int per_band = BAND * columns;
  const int first = tile / per_band * BAND;
  const int height = min(rows - first, BAND);
  row = first + tile % per_band % height;
  column = tile % per_band / height;
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
// The threads of one warpgroup (or any multiple of 32) meet at named barrier ``id`` (0 is __syncthreads').
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
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
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap& map, int inner, int middle, int outer, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(inner), "r"(middle), "r"(outer), "r"(bar)
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

// Two adjacent values rounded once each into the output's 2-byte type, as one 32-bit word (the
// first in the low half: at the lower address once stored).
template <typename Out>
__device__ __forceinline__ uint32_t packed_pair(float v0, float v1) {
  static_assert(sizeof(Out) == 2, "a pair of 2-byte values");
  using Pair = typename std::conditional<std::is_same<Out, __nv_bfloat16>::value, __nv_bfloat162, __half2>::type;
  Pair pair;
  store_value(&pair.x, v0);
  store_value(&pair.y, v1);
  return *reinterpret_cast<uint32_t*>(&pair);
}

// Two adjacent values of an output row rounded once each, as one store where ``both`` (and p is
// aligned for it), else the first alone.
template <typename Out>
__device__ __forceinline__ void store_pair(Out* p, float v0, float v1, bool both) {
  if constexpr (sizeof(Out) == 2) {
    if (both) {
      *reinterpret_cast<uint32_t*>(p) = packed_pair<Out>(v0, v1);
      return;
    }
  } else if (both) {
    *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
    return;
  }
  store_value(p, v0);
}

// A quad of lanes (t = lane % 4) trades words so that lane t's word u becomes lane u's word t: a
// wgmma accumulator's quad holds each 8-column block as four lanes' pairs, and afterwards a lane
// holds one block whole, to store as one contiguous run. Two exchanges, one per bit of t.
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], int t) {
#pragma unroll
  for (int bit = 1; bit <= 2; bit *= 2) {
    const bool high = t & bit;
#pragma unroll
    for (int low = 0; low < 4; ++low) {
      if (low & bit) continue;
      // of words low and low | bit, the one whose bit differs from t's goes to lane t ^ bit, and the partner's comes back in its place
      const uint32_t got = __shfl_xor_sync(0xffffffffu, high ? w[low] : w[low | bit], bit);
      if (high) w[low] = got;
      else w[low | bit] = got;
    }
  }
}

// FP8 codes (rows, k) as a GEMM's TMA reads them: k contiguous, rows 16-byte aligned; ``what``
// names the caller and ``name`` the operand in errors.
inline void check_fp8_codes(const at::Tensor& codes, const char* what, const char* name) {
  TORCH_CHECK(codes.is_cuda() && codes.dim() == 2 && (codes.scalar_type() == at::kFloat8_e4m3fn || codes.scalar_type() == at::kFloat8_e5m2) &&
                  codes.stride(1) == 1 && codes.stride(0) % 16 == 0 && reinterpret_cast<uintptr_t>(codes.data_ptr()) % 16 == 0,
              what, ": ", name, " must be CUDA float8_e4m3fn or float8_e5m2 codes (rows, k), k contiguous, rows 16-byte aligned; got ",
              codes.scalar_type(), " ", codes.sizes(), " strides ", codes.strides(), " on ", codes.device());
}

// The element of FP8 codes, as the kernels' templates take it.
inline int fp8_element(const at::Tensor& codes) { return codes.scalar_type() == at::kFloat8_e5m2 ? E5M2 : E4M3; }

// A GEMM's K split, its splits' fp32 sums added in split order afterwards: ``requested`` splits or,
// for 0, enough to fill the GPU's ``sms`` once with ``tiles`` output tiles, each split at least
// ``least`` of the ``steps`` K steps long (a split's fixed cost, its first copies and its sums
// written and read again, against the steps it multiplies); then as many as leave none empty.
struct KSplit {
  int64_t splits, steps_per_split;
};
inline KSplit k_split(int64_t requested, int64_t tiles, int64_t steps, int sms, int64_t least) {
  steps = std::max<int64_t>(steps, 1);
  int64_t splits = requested > 0 ? requested : std::max<int64_t>(1, std::min<int64_t>(sms / tiles, steps / least));
  splits = std::min(splits, steps);
  const int64_t per_split = (steps + splits - 1) / splits;
  return {(steps + per_split - 1) / per_split, per_split};
}

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

// A TMA descriptor of a tensor of ``rank`` (2 or 3) dims of ``element``-byte values, innermost
// first (``dims``; ``strides``: the outer dims' in bytes), copied in boxes of ``box``, zeros past
// its edges; ``what`` names the caller in errors.
inline CUtensorMap tensor_map(const char* what, const void* data, CUtensorMapDataType type, int element, int rank, const int64_t* dims,
                              const int64_t* strides, const int* box, CUtensorMapSwizzle swizzle) {
  static const auto encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    const cudaError_t error = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    TORCH_CHECK(error == cudaSuccess && found == cudaDriverEntryPointSuccess && fn != nullptr,
                "graphquant: the CUDA driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  TORCH_CHECK(rank == 2 || rank == 3, what, ": TMA descriptors of 2 or 3 dims, not ", rank);
  CUtensorMap map;
  cuuint64_t sizes[3], outer[2];
  cuuint32_t boxes[3];
  const cuuint32_t unit[3] = {1, 1, 1};
  for (int d = 0; d < rank; ++d) {
    sizes[d] = static_cast<cuuint64_t>(dims[d]);
    boxes[d] = static_cast<cuuint32_t>(box[d]);
    if (d > 0) outer[d - 1] = static_cast<cuuint64_t>(strides[d - 1]);
  }
  const CUresult result = encode(&map, type, rank, const_cast<void*>(data), sizes, outer, boxes, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(result == CUDA_SUCCESS, what, ": cuTensorMapEncodeTiled failed (", static_cast<int>(result), ") for a tensor of ", element,
              "-byte elements, dims (innermost first) ", c10::IntArrayRef(dims, rank), ", outer strides ", c10::IntArrayRef(strides, rank - 1),
              " bytes, box ", std::vector<int>(box, box + rank));
  return map;
}

// A 2-D one: a row-major (rows, cols) tensor (row stride in bytes) in boxes of (box_rows, box_cols).
inline CUtensorMap tensor_map(const char* what, const void* data, CUtensorMapDataType type, int element, int64_t rows, int64_t cols,
                              int64_t stride, int box_rows, int box_cols, CUtensorMapSwizzle swizzle) {
  const int64_t dims[2] = {cols, rows};
  const int box[2] = {box_cols, box_rows};
  return tensor_map(what, data, type, element, 2, dims, &stride, box, swizzle);
}

}  // namespace hopper
}  // namespace gq
