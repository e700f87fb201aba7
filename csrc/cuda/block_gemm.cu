// graphquant._C.block_gemm: out (m, n) = A @ B^T (+ bias) for DeepSeek-V3's block-scaled FP8
// operands on Hopper: A's codes (m, k) in 1x128 blocks, B's (n, k) in 128x128 tiles, each block's
// scale an fp32 factor. cuBLASLt's blockwise GEMM multiplies by the wrong tile scales where k / 128
// is no multiple of 4, so there graphquant pads k to a multiple of 512 each call
// (scaled_mm.TILE_SCALED_K), a copy of both operands that made the product 1.04-3.73x slower than
// this kernel (benchmarks/NOTES.md, block_gemm.py); this one takes any k of whole 16 bytes (TMA's rows),
// any m and n, and reads the scales as the formats store them. Where cuBLASLt takes k as it is, it
// is faster (about 1.3x at large shapes), and the plan leaves those GEMMs to it.
//
// Numerics: DeepSeek-V3's recipe, as graphquant.formats' reference multiplies: each 128-long K
// block's products summed on the FP8 tensor cores (exact products, their accumulator's sums), that
// partial sum times (A's block scale x B's tile scale) added in fp32, the bias added to the fp32
// sum, one rounding to the output's dtype.
//
// Layout: a persistent CTA walks output tiles of 128 x 128 (GROUP_M tiles of rows a column of
// tiles, so that the tiles running at once share their operands in L2; two CTAs a cluster share
// their B tile's copy). Where the tiles fill few of the SMs (a few rows of A), K is split: each
// split's tiles are work of their own, their fp32 sums written apart and then added in split order
// (the same bits every call) before the bias and the one rounding. A warpgroup copies K
// blocks of both operands by TMA into STAGES stages; two warpgroups each multiply 64 of the rows:
// four wgmmas a block into a partial accumulator, then its promotion into the fp32 sums, while the
// other warpgroup's wgmmas keep the tensor cores busy.
//
// CUDA only, sm_90a only (wgmma): the CPU emulation of the kernels (tests/emulation) does not build it.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "hopper.cuh"

namespace gq {
namespace {

using namespace hopper;

constexpr int TILE = 128;  // a CTA's output tile is TILE x TILE, a stage holds TILE of K: one block of scales
constexpr int PRODUCERS = 128, CONSUMERS = 256, THREADS = PRODUCERS + CONSUMERS;  // a warpgroup copying, two multiplying
constexpr int STAGE_BYTES = 2 * TILE * TILE;  // A's and B's codes, 128 bytes a row (one swizzle atom row)
constexpr int STAGES = 6;
constexpr int SMEM = STAGES * (STAGE_BYTES + 16) + 1024;  // + two barriers a stage, + the base's alignment to 1024
constexpr int GROUP_M = 16;

struct Args {
  const float *a_scale, *b_scale;  // (m, blocks), (ceil(n / 128), blocks), any strides
  void* out;
  const void* bias;
  float* partial;  // (splits, m, n) fp32 where K is split, else null
  int64_t a_scale_rows, a_scale_cols, b_scale_rows, b_scale_cols;  // strides, in elements
  int m, n, blocks, n_tiles, out_kind, bias_kind;
  int cluster_rows;  // rows of the output's tiles, CTAS tiles (a cluster's) a row
  int splits, blocks_per_split;
};

// The work item ``item`` of a CTA's cluster: its tile (row, column of tiles) and its K split's blocks.
struct Work {
  int row, column, first, blocks;
};
template <int CTAS>
__device__ __forceinline__ Work work_of(int item, const Args& args) {
  const int cluster_tiles = args.cluster_rows * args.n_tiles, split = item / cluster_tiles;
  Work w;
  tile_in_bands<GROUP_M / CTAS>(item % cluster_tiles, args.cluster_rows, args.n_tiles, w.row, w.column);
  w.first = split * args.blocks_per_split;
  w.blocks = min(args.blocks_per_split, args.blocks - w.first);
  return w;
}

// A thread's sums (sum 4j + 2h + b: row rows[h], column n0 + 8j + 2t + b), plus the bias, rounded
// once into out (m, n) row-major; column pairs written as one store where n is even.
template <typename Out>
__device__ __forceinline__ void store_tile(const float (&acc)[64], const Args& args, Out* out, const void* bias_values, int n0, int t,
                                           const int (&rows)[2]) {
  const bool even = args.n % 2 == 0;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int column = n0 + 8 * j + 2 * t;
    if (column >= args.n) continue;
    float bias[2] = {0.f, 0.f};
    if (bias_values != nullptr) {
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int c = min(column + b, args.n - 1);
        bias[b] = bias_value(bias_values, args.bias_kind, c);
      }
    }
    const bool both = column + 1 < args.n;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (rows[h] >= args.m) continue;
      Out* p = out + static_cast<int64_t>(rows[h]) * args.n + column;
      const float v0 = acc[4 * j + 2 * h] + bias[0], v1 = acc[4 * j + 2 * h + 1] + bias[1];
      store_pair(p, v0, v1, both && even);
      if (both && !even) store_value(p + 1, v1);
    }
  }
}

// A cluster of CTAS (1 or 2) CTAs takes as many tiles of one column, each CTA one, and reads their
// B tile from L2 once: each CTA copies its half into both (TMA multicast).
template <int A, int CTAS>
__global__ void __launch_bounds__(THREADS, 1) block_gemm_kernel(const Args args, const __grid_constant__ CUtensorMap a_map,
                                                               const __grid_constant__ CUtensorMap b_map) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
  constexpr int HALF = TILE * TILE / 2;
  extern __shared__ uint8_t raw[];
  const uint32_t raw_address = smem_address(raw);
  const uint32_t base = (raw_address + 1023) & ~1023u;
  const uint32_t full = base + STAGES * STAGE_BYTES, empty = full + 8 * STAGES;  // a barrier a stage each
  const int tid = threadIdx.x;
  const uint32_t rank = CTAS > 1 ? cluster_rank() : 0, partner = 1 - rank;
  const int items = args.cluster_rows * args.n_tiles * args.splits;
  const int cluster = blockIdx.x / CTAS, clusters = gridDim.x / CTAS;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      barrier_init(full + 8 * s, 1);
      barrier_init(empty + 8 * s, CTAS * CONSUMERS / 32);  // an arrival a consumer warp of each CTA that copies into it
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if constexpr (CTAS > 1) cluster_sync();
  else __syncthreads();

  if (tid < PRODUCERS) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (tid == 0) {
      int j = 0;  // stages filled so far, over every tile
      for (int item = cluster; item < items; item += clusters) {
        const Work w = work_of<CTAS>(item, args);
        const int tm = w.row * CTAS + rank, tn = w.column;
        for (int block = w.first; block < w.first + w.blocks; ++block, ++j) {
          const int s = j % STAGES;
          if (j >= STAGES) barrier_wait(empty + 8 * s, (j / STAGES - 1) & 1);
          const uint32_t stage = base + s * STAGE_BYTES, bar = full + 8 * s;
          expect_bytes(bar, STAGE_BYTES);
          tma_load(stage, a_map, block * TILE, tm * TILE, bar);
          if constexpr (CTAS == 2) {
            tma_multicast(stage + TILE * TILE + rank * HALF, b_map, block * TILE, tn * TILE + rank * TILE / 2, bar, 3);
          } else {
            tma_load(stage + TILE * TILE, b_map, block * TILE, tn * TILE, bar);
          }
        }
      }
    }
    __syncwarp();
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int consumer = tid - PRODUCERS;
    const int lane = consumer % 32, warp = (consumer % 128) / 32, warpgroup = consumer / 128;
    const int g = lane / 4, t = lane % 4;
    const int row_in_tile = warpgroup * 64 + warp * 16 + g;  // this thread's rows of the tile: it and it + 8
    int j = 0;  // stages consumed so far, over every tile
    for (int item = cluster; item < items; item += clusters) {
      const Work w = work_of<CTAS>(item, args);
      const int tm = w.row * CTAS + rank, tn = w.column;  // past the output's last row where a cluster's tiles are: zeros, not stored
      const int rows[2] = {tm * TILE + row_in_tile, tm * TILE + row_in_tile + 8};
      const float* a_scale[2] = {args.a_scale + static_cast<int64_t>(min(rows[0], args.m - 1)) * args.a_scale_rows,
                                 args.a_scale + static_cast<int64_t>(min(rows[1], args.m - 1)) * args.a_scale_rows};
      const float* b_scale = args.b_scale + static_cast<int64_t>(tn) * args.b_scale_rows;
      float acc[64], partial[64];
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = 0.f;
      // The split's first block's scales; each block's wgmmas then run while the next block's are read.
      const int64_t first = w.first, last = w.first + w.blocks;
      float tile_scale = b_scale[first * args.b_scale_cols];
      float row_scale[2] = {a_scale[0][first * args.a_scale_cols], a_scale[1][first * args.a_scale_cols]};
      for (int64_t block = first; block < last; ++block, ++j) {
        const int s = j % STAGES;
        const uint32_t a_stage = base + s * STAGE_BYTES + warpgroup * 64 * TILE, b_stage = base + s * STAGE_BYTES + TILE * TILE;
        barrier_wait(full + 8 * s, (j / STAGES) & 1);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) Fp8Wgmma<A, E4M3>::mma(partial, descriptor(a_stage + 32 * kk), descriptor(b_stage + 32 * kk), kk);
        wgmma_commit();
        const float factor[2] = {row_scale[0] * tile_scale, row_scale[1] * tile_scale};
        if (block + 1 < last) {
          const int64_t next = block + 1;
          tile_scale = b_scale[next * args.b_scale_cols];
          row_scale[0] = a_scale[0][next * args.a_scale_cols];
          row_scale[1] = a_scale[1][next * args.a_scale_cols];
        }
        wgmma_wait<0>();
        keep(partial);
        if (lane == 0) {  // the stage read: each CTA that copies into it may fill it again
          if constexpr (CTAS > 1) {
            cluster_arrive(empty + 8 * s, rank);
            cluster_arrive(empty + 8 * s, partner);
          } else {
            barrier_arrive(empty + 8 * s);
          }
        }
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = fmaf(partial[i], factor[(i >> 1) & 1], acc[i]);
      }
      const int n0 = tn * TILE;
      if (args.partial != nullptr) {  // a K split's sums, the bias and rounding left to split_sum_kernel
        const int64_t split = w.first / args.blocks_per_split;
        store_tile<float>(acc, args, args.partial + split * args.m * args.n, nullptr, n0, t, rows);
      } else if (args.out_kind == BF16) {
        store_tile(acc, args, static_cast<__nv_bfloat16*>(args.out), args.bias, n0, t, rows);
      } else if (args.out_kind == F16) {
        store_tile(acc, args, static_cast<__half*>(args.out), args.bias, n0, t, rows);
      } else {
        store_tile(acc, args, static_cast<float*>(args.out), args.bias, n0, t, rows);
      }
    }
  }
  // No CTA leaves while another may still copy into its stages or arrive on its barriers.
  if constexpr (CTAS > 1) cluster_sync();
#endif
}

// The K splits' sums added in split order, then the bias, and the one rounding to out's dtype.
template <typename Out>
__global__ void split_sum_kernel(const Args args) {
  const int64_t total = static_cast<int64_t>(args.m) * args.n;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float sum = args.partial[i];
    for (int s = 1; s < args.splits; ++s) sum += args.partial[s * total + i];
    if (args.bias != nullptr) sum += bias_value(args.bias, args.bias_kind, static_cast<int>(i % args.n));
    store_value(static_cast<Out*>(args.out) + i, sum);
  }
}

void check_scales(const at::Tensor& scale, int64_t rows, int64_t blocks, const at::Tensor& codes, const char* name) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 2 && scale.size(0) == rows && scale.size(1) == blocks &&
                  scale.device() == codes.device(),
              "graphquant.block_gemm: ", name, " must be float32 (", rows, ", ", blocks, ") on ", codes.device(), ", got ", scale.scalar_type(), " ",
              scale.sizes(), " on ", scale.device());
}

// The clusters of ``kernel`` (``config``'s, of ``ctas`` CTAs each) that fit on the current GPU at
// once, a GPC's SMs holding whole clusters: the persistent grid. Worked out once a kernel and device.
int resident_clusters(const void* kernel, cudaLaunchConfig_t config, int ctas, int sms) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> known;
  int device = 0;
  TORCH_CHECK(cudaGetDevice(&device) == cudaSuccess, "graphquant.block_gemm: no current CUDA device");
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = known.find({kernel, device});
  if (found != known.end()) return found->second;
  config.gridDim = dim3(ctas * sms);
  int clusters = 0;
  const cudaError_t error = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config);
  TORCH_CHECK(error == cudaSuccess && clusters > 0, "graphquant.block_gemm: no cluster of ", ctas, " CTAs fits device ", device, " (",
              cudaGetErrorString(error), ")");
  return known[{kernel, device}] = clusters;
}

template <int A, int CTAS>
void launch(Args args, const at::Tensor& a, const at::Tensor& b, int m_tiles, int sms, cudaStream_t stream) {
  auto* kernel = block_gemm_kernel<A, CTAS>;
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = CTAS;
  cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
  config.blockDim = dim3(THREADS);
  config.dynamicSmemBytes = SMEM;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  opt_in_shared_memory(reinterpret_cast<const void*>(kernel), SMEM, "graphquant.block_gemm");
  const int resident = resident_clusters(reinterpret_cast<const void*>(kernel), config, CTAS, sms);
  args.cluster_rows = (m_tiles + CTAS - 1) / CTAS;
  config.gridDim = dim3(CTAS * std::min(resident, args.cluster_rows * args.n_tiles * args.splits));
  const CUtensorMap a_map = tensor_map("graphquant.block_gemm", a.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, a.size(0), a.size(1),
                                       a.stride(0), TILE, TILE, CU_TENSOR_MAP_SWIZZLE_128B);
  const CUtensorMap b_map = tensor_map("graphquant.block_gemm", b.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, b.size(0), b.size(1),
                                       b.stride(0), TILE / CTAS, TILE, CU_TENSOR_MAP_SWIZZLE_128B);
  const cudaError_t error = cudaLaunchKernelEx(&config, kernel, args, a_map, b_map);
  TORCH_CHECK(error == cudaSuccess, "graphquant.block_gemm: the launch failed: ", cudaGetErrorString(error));
}

// Two CTAs a cluster where A has more than one row of tiles (1.03-1.12x one at 1000 to 16384 rows on
// the H200; with one row of tiles the second CTA would multiply nothing).
template <int A>
void launch_clusters(const Args& args, const at::Tensor& a, const at::Tensor& b, int m_tiles, int sms, cudaStream_t stream) {
  if (m_tiles > 1) launch<A, 2>(args, a, b, m_tiles, sms, stream);
  else launch<A, 1>(args, a, b, m_tiles, sms, stream);
}

at::Tensor block_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale, const at::Tensor& b_scale,
                      at::ScalarType out_dtype, const std::optional<at::Tensor>& bias, int64_t splits) {
  check_fp8_codes(a, "graphquant.block_gemm", "A");
  check_fp8_codes(b, "graphquant.block_gemm", "B");
  TORCH_CHECK(b.scalar_type() == at::kFloat8_e4m3fn, "graphquant.block_gemm multiplies E4M3 or E5M2 A by E4M3 B (weights), not ", b.scalar_type());
  const auto* properties = at::cuda::getDeviceProperties(a.get_device());
  TORCH_CHECK(properties->major == 9 && properties->minor == 0,
              "graphquant.block_gemm runs on sm_90 (Hopper's wgmma) alone, not on sm_", properties->major, properties->minor);
  TORCH_CHECK(a.device() == b.device() && a.size(1) == b.size(1),
              "graphquant.block_gemm multiplies A (m, k) by B (n, k) on one device, got A ", a.sizes(), " on ", a.device(), " and B ",
              b.sizes(), " on ", b.device());
  const int64_t m = a.size(0), n = b.size(0), k = a.size(1), blocks = (k + TILE - 1) / TILE;
  check_scales(a_scale, m, blocks, a, "A's 1x128 scales");
  check_scales(b_scale, (n + TILE - 1) / TILE, blocks, b, "B's 128x128 scales");
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kHalf || out_dtype == at::kFloat,
              "graphquant.block_gemm writes bfloat16, float16 or float32, not ", out_dtype);
  TORCH_CHECK(!bias || ((bias->scalar_type() == at::kBFloat16 || bias->scalar_type() == at::kHalf) && bias->numel() == n &&
                        bias->is_contiguous() && bias->device() == a.device()),
              "graphquant.block_gemm: the bias must be ", n, " contiguous bfloat16 or float16 values on A's device");
  TORCH_CHECK(m < (int64_t{1} << 31) && n < (int64_t{1} << 31), "graphquant.block_gemm takes m and n below 2^31, got ", m, " and ", n);
  TORCH_CHECK(splits >= 0, "graphquant.block_gemm: splits must be 0 (chosen for the GPU) or a count of K splits, got ", splits);
  const c10::cuda::CUDAGuard guard(a.device());
  auto out = at::empty({m, n}, a.options().dtype(out_dtype));
  if (m == 0 || n == 0) return out;
  if (k == 0) return out.zero_();
  const int m_tiles = static_cast<int>((m + TILE - 1) / TILE), n_tiles = static_cast<int>((n + TILE - 1) / TILE);
  const int sms = properties->multiProcessorCount;
  // Where the output's tiles fill at most half the SMs, K splits (each at least 4 blocks long).
  const KSplit split = k_split(splits, int64_t{m_tiles} * n_tiles, blocks, sms, 4);
  const int64_t per_split = split.steps_per_split;
  splits = split.splits;
  at::Tensor partial;
  if (splits > 1) partial = at::empty({splits, m, n}, a.options().dtype(at::kFloat));
  Args args{a_scale.data_ptr<float>(),
            b_scale.data_ptr<float>(),
            out.data_ptr(),
            bias ? bias->data_ptr() : nullptr,
            splits > 1 ? partial.data_ptr<float>() : nullptr,
            a_scale.stride(0),
            a_scale.stride(1),
            b_scale.stride(0),
            b_scale.stride(1),
            static_cast<int>(m),
            static_cast<int>(n),
            static_cast<int>(blocks),
            n_tiles,
            kind(out_dtype),
            bias ? kind(bias->scalar_type()) : BF16,
            0,
            static_cast<int>(splits),
            static_cast<int>(per_split)};
  auto stream = at::cuda::getCurrentCUDAStream();
  if (fp8_element(a) == E4M3) launch_clusters<E4M3>(args, a, b, m_tiles, sms, stream);
  else launch_clusters<E5M2>(args, a, b, m_tiles, sms, stream);
  if (splits > 1) {
    const int threads = 256;
    const int64_t wanted = (m * n + threads - 1) / threads;
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(wanted, int64_t{sms} * 8));
    if (out_dtype == at::kBFloat16) split_sum_kernel<__nv_bfloat16><<<grid, threads, 0, stream>>>(args);
    else if (out_dtype == at::kHalf) split_sum_kernel<__half><<<grid, threads, 0, stream>>>(args);
    else split_sum_kernel<float><<<grid, threads, 0, stream>>>(args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

}  // namespace
}  // namespace gq

void register_block_gemm(pybind11::module_& m) {
  m.def("block_gemm", &gq::block_gemm,
        "out (m, n) = A @ B^T (+ bias) for FP8 codes A (m, k) in 1x128 blocks and B (n, k) in 128x128 tiles (DeepSeek-V3's "
        "recipe) on sm_90's FP8 tensor cores: each 128-long block's partial sum times a_scale[row, block] * b_scale[row / 128, "
        "block] added in fp32, the bias (n bfloat16 or float16, optional) added before one rounding to out_dtype; k a multiple of 16; "
        "splits: K's split, its splits' fp32 sums added in split order (0: chosen for the GPU's SMs)",
        pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("a_scale"), pybind11::arg("b_scale"), pybind11::arg("out_dtype"),
        pybind11::arg("bias"), pybind11::arg("splits") = 0);
}
