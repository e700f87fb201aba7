// graphquant._C.grouped_fp8_gemm: the FP8 grouped GEMM of an MoE layer's experts on Hopper,
// every group's product in one persistent launch, the group offsets read on the device. The
// Triton grouped GEMM (graphquant.kernels.triton_grouped_fp8) waits for each K tile's wgmmas
// before it promotes them, and no other warps keep the tensor cores busy meanwhile; here a
// warpgroup copies the operands by TMA and two multiply, as graphquant.block_gemm does
// (benchmarks/NOTES.md, grouped_gemm.py, has where it stands).
//
// The two products of graphquant.kernels.grouped, on graphquant.formats.groups' padded layout
// (every group starts at a multiple of 128 rows, so a tile of 128 rows lies in one group):
//
//   tokens x experts (fprop, dgrad)  out[source[r]] = A[r] @ B_g^T for the padded rows r of group g,
//                                    B an expert stack read as (groups, n', K) by a 3-D TMA descriptor
//   tokens x tokens (wgrad)          out[g] = A_g B_g^T over group g's padded rows (an empty group: 0),
//                                    A (m', rows) and B (n, rows): columnwise data, stored transposed
//
// Numerics: the Triton kernel's, bit for bit. Each 128-long K block's products are summed on the
// FP8 tensor cores (four m64n128k32 wgmmas); FAST leaves every block in their accumulator, PROMOTED
// adds each block's partial sum into fp32 (fp8.PROMOTED_PRODUCTS), BLOCK adds it times its two block
// scales (DeepSeek-V3's 1x128 A by 128x128 B). Per-tensor and per-row factors multiply the fp32
// sum once, acc * (a's x b's); one rounding to the output's dtype.
//
// CUDA only, sm_90a only (wgmma): the CPU emulation of the kernels (tests/emulation) does not build it.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "hopper.cuh"

namespace gq {
namespace {

using namespace hopper;

constexpr int TILE = 128;  // a CTA's output tile is TILE x TILE, a stage holds TILE of K
constexpr int PRODUCERS = 128, CONSUMERS = 256, THREADS = PRODUCERS + CONSUMERS;  // a warpgroup copying, two multiplying
constexpr int STAGE_BYTES = 2 * TILE * TILE;  // A's and B's codes, 128 bytes a row (one swizzle atom row)
constexpr int STAGES = 6;
constexpr int SMEM = STAGES * (STAGE_BYTES + 16) + 1024;  // + two barriers a stage, + the base's alignment to 1024
constexpr int BAND = 16;  // tile rows walked a column at a time
enum Mode { FAST = 0, PROMOTED = 1, BLOCK = 2 };

// Where an operand's scales lie: GEMM row i of group g in K block kb scaled by
// tensor[g * group + (i / rows) * row + kb * block] (graphquant.kernels.grouped_operands.Scales).
struct Scales {
  const float* tensor;
  int64_t group, row, block;
  int rows;
  __device__ __forceinline__ float at(int64_t g, int64_t i, int64_t kb) const { return tensor[g * group + i / rows * row + kb * block]; }
};

struct Args {
  void* out;
  const int64_t* row_group;  // tokens x experts: each padded row's group
  const int64_t* source;     // tokens x experts: the output row of each padded row, -1 for a pad row
  const int32_t* ends;       // each group's cumulative padded end
  Scales a_scale, b_scale;
  int groups, m, n, k_blocks;  // m: tokens x tokens' output rows; k_blocks: tokens x experts' K blocks
  int m_tiles, n_tiles, out_kind;
  bool tokens_by_tokens;
};

// What one output tile multiplies: its group, tile row and column, its first K (A's and B's
// column) and number of K blocks.
struct Work {
  int group, tm, tn, k0, blocks;
};

__device__ __forceinline__ int group_begin(const Args& args, int g) { return g == 0 ? 0 : args.ends[g - 1]; }

__device__ __forceinline__ Work work_of(const Args& args, int tile, int live_m_tiles) {
  Work w;
  if (args.tokens_by_tokens) {
    const int per_group = args.m_tiles * args.n_tiles;
    w.group = tile / per_group;
    tile_in_bands<BAND>(tile % per_group, args.m_tiles, args.n_tiles, w.tm, w.tn);
    w.k0 = group_begin(args, w.group);
    w.blocks = (args.ends[w.group] - w.k0) / TILE;
  } else {
    tile_in_bands<BAND>(tile, live_m_tiles, args.n_tiles, w.tm, w.tn);
    w.group = static_cast<int>(args.row_group[static_cast<int64_t>(w.tm) * TILE]);
    w.k0 = 0;
    w.blocks = args.k_blocks;
  }
  return w;
}

// The tiles of the launch: tokens x experts' rows of tiles up to the last group's end (read on the
// device), tokens x tokens' every group's.
__device__ __forceinline__ int live_rows_of_tiles(const Args& args) {
  return args.tokens_by_tokens ? args.m_tiles : (args.ends[args.groups - 1] + TILE - 1) / TILE;
}

__device__ __forceinline__ int tile_count(const Args& args, int live_m_tiles) {
  return (args.tokens_by_tokens ? args.groups : 1) * live_m_tiles * args.n_tiles;
}

// A thread's sums (sum 4j + 2h + b: tile row rows[h], column n0 + 8j + 2t + b) times their
// per-tensor or per-row factors (none under BLOCK), rounded once into the output.
template <typename Out, int MODE>
__device__ __forceinline__ void store_tile(const float (&acc)[64], const Args& args, const Work& w, int t, const int (&rows)[2]) {
  Out* out = static_cast<Out*>(args.out);
  const int n0 = w.tn * TILE;
  int64_t out_row[2];
  float row_factor[2] = {1.f, 1.f};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = w.tm * TILE + rows[h];
    if (args.tokens_by_tokens) {
      out_row[h] = row < args.m ? (static_cast<int64_t>(w.group) * args.m + row) * args.n : -1;
    } else {
      const int64_t source = args.source[static_cast<int64_t>(row)];
      out_row[h] = source < 0 ? -1 : source * args.n;
    }
    if constexpr (MODE != BLOCK) {
      if (out_row[h] >= 0) row_factor[h] = args.a_scale.at(args.tokens_by_tokens ? w.group : 0, row, 0);
    }
  }
  const bool even = args.n % 2 == 0;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int column = n0 + 8 * j + 2 * t;
    if (column >= args.n) continue;
    const bool both = column + 1 < args.n;
    float column_factor[2] = {1.f, 1.f};
    if constexpr (MODE != BLOCK) {
#pragma unroll
      for (int b = 0; b < 2; ++b) column_factor[b] = args.b_scale.at(w.group, min(column + b, args.n - 1), 0);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (out_row[h] < 0) continue;
      Out* p = out + out_row[h] + column;
      float v[2] = {acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]};
      if constexpr (MODE != BLOCK) {
#pragma unroll
        for (int b = 0; b < 2; ++b) v[b] = v[b] * (row_factor[h] * column_factor[b]);
      }
      store_pair(p, v[0], v[1], both && even);
      if (both && !even) store_value(p + 1, v[1]);
    }
  }
}

template <int A, int B, int MODE>
__global__ void __launch_bounds__(THREADS, 1) grouped_gemm_kernel(const Args args, const __grid_constant__ CUtensorMap a_map,
                                                                 const __grid_constant__ CUtensorMap b_map) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
  extern __shared__ uint8_t raw[];
  const uint32_t base = (smem_address(raw) + 1023) & ~1023u;
  const uint32_t full = base + STAGES * STAGE_BYTES, empty = full + 8 * STAGES;  // a barrier a stage each
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      barrier_init(full + 8 * s, 1);
      barrier_init(empty + 8 * s, CONSUMERS / 32);  // an arrival a consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int live_m_tiles = live_rows_of_tiles(args), tiles = tile_count(args, live_m_tiles);

  if (tid < PRODUCERS) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (tid == 0) {
      int j = 0;  // stages filled so far, over every tile
      for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const Work w = work_of(args, tile, live_m_tiles);
        for (int block = 0; block < w.blocks; ++block, ++j) {
          const int s = j % STAGES;
          if (j >= STAGES) barrier_wait(empty + 8 * s, (j / STAGES - 1) & 1);
          const uint32_t stage = base + s * STAGE_BYTES, bar = full + 8 * s;
          const int k = w.k0 + block * TILE;
          expect_bytes(bar, STAGE_BYTES);
          tma_load(stage, a_map, k, w.tm * TILE, bar);
          tma_load(stage + TILE * TILE, b_map, k, w.tn * TILE, args.tokens_by_tokens ? 0 : w.group, bar);
        }
      }
    }
    __syncwarp();
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int consumer = tid - PRODUCERS;
    const int lane = consumer % 32, warp = (consumer % 128) / 32, warpgroup = consumer / 128;
    const int g = lane / 4, t = lane % 4;
    const int rows[2] = {warpgroup * 64 + warp * 16 + g, warpgroup * 64 + warp * 16 + g + 8};  // this thread's rows of the tile
    int j = 0;  // stages consumed so far, over every tile
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      const Work w = work_of(args, tile, live_m_tiles);
      float acc[64], partial[64];
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = 0.f;
      for (int block = 0; block < w.blocks; ++block, ++j) {
        const int s = j % STAGES;
        const uint32_t a_stage = base + s * STAGE_BYTES + warpgroup * 64 * TILE, b_stage = base + s * STAGE_BYTES + TILE * TILE;
        barrier_wait(full + 8 * s, (j / STAGES) & 1);
        wgmma_fence();
        if constexpr (MODE == FAST) {
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) Fp8Wgmma<A, B>::mma(acc, descriptor(a_stage + 32 * kk), descriptor(b_stage + 32 * kk), block + kk);
        } else {
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) Fp8Wgmma<A, B>::mma(partial, descriptor(a_stage + 32 * kk), descriptor(b_stage + 32 * kk), kk);
        }
        wgmma_commit();
        float factor[2] = {1.f, 1.f};
        if constexpr (MODE == BLOCK) {
          const int64_t kb = (w.k0 / TILE) + block;
          const float tile_scale = args.b_scale.at(w.group, static_cast<int64_t>(w.tn) * TILE, kb);
          for (int h = 0; h < 2; ++h) factor[h] = args.a_scale.at(0, static_cast<int64_t>(w.tm) * TILE + rows[h], kb) * tile_scale;
        }
        wgmma_wait<0>();
        if constexpr (MODE == FAST) keep(acc);
        else keep(partial);
        if (lane == 0) barrier_arrive(empty + 8 * s);  // the stage read: the producer may fill it again
        if constexpr (MODE == PROMOTED) {
#pragma unroll
          for (int i = 0; i < 64; ++i) acc[i] += partial[i];
        } else if constexpr (MODE == BLOCK) {
#pragma unroll
          for (int i = 0; i < 64; ++i) acc[i] = fmaf(partial[i], factor[(i >> 1) & 1], acc[i]);
        }
      }
      if (args.out_kind == BF16) store_tile<__nv_bfloat16, MODE>(acc, args, w, t, rows);
      else if (args.out_kind == F16) store_tile<__half, MODE>(acc, args, w, t, rows);
      else store_tile<float, MODE>(acc, args, w, t, rows);
    }
  }
#endif
}

// FP8 codes (rows, cols) as TMA reads them: the reduction dim contiguous, rows 16-byte aligned.
void check_codes(const at::Tensor& codes, const char* name) {
  TORCH_CHECK(codes.is_cuda() && codes.dim() == 2 && (codes.scalar_type() == at::kFloat8_e4m3fn || codes.scalar_type() == at::kFloat8_e5m2) &&
                  codes.stride(1) == 1 && codes.stride(0) % 16 == 0 && reinterpret_cast<uintptr_t>(codes.data_ptr()) % 16 == 0,
              "graphquant.grouped_fp8_gemm: ", name, " must be CUDA float8_e4m3fn or float8_e5m2 codes (rows, cols), cols contiguous, rows ",
              "16-byte aligned; got ", codes.scalar_type(), " ", codes.sizes(), " strides ", codes.strides(), " on ", codes.device());
}

Scales scales_of(const at::Tensor& tensor, const std::vector<int64_t>& layout, const at::Tensor& codes, const char* name) {
  TORCH_CHECK(tensor.scalar_type() == at::kFloat && tensor.device() == codes.device() && layout.size() == 4 && layout[3] >= 1,
              "graphquant.grouped_fp8_gemm: ", name, "'s scales must be float32 on ", codes.device(),
              " with a layout (group, row, block strides, rows a scale); got ", tensor.scalar_type(), " on ", tensor.device(), " and ",
              layout.size(), " layout values");
  return Scales{tensor.data_ptr<float>(), layout[0], layout[1], layout[2], static_cast<int>(layout[3])};
}

template <int A, int B, int MODE>
void launch(const Args& args, const CUtensorMap& a_map, const CUtensorMap& b_map, int sms, cudaStream_t stream) {
  auto* kernel = grouped_gemm_kernel<A, B, MODE>;
  opt_in_shared_memory(reinterpret_cast<const void*>(kernel), SMEM, "graphquant.grouped_fp8_gemm");
  kernel<<<sms, THREADS, SMEM, stream>>>(args, a_map, b_map);
  const cudaError_t error = cudaGetLastError();
  TORCH_CHECK(error == cudaSuccess, "graphquant.grouped_fp8_gemm: the launch failed: ", cudaGetErrorString(error));
}

template <int MODE>
void launch_elements(const Args& args, int a, int b, const CUtensorMap& a_map, const CUtensorMap& b_map, int sms, cudaStream_t stream) {
  if (a == E4M3 && b == E4M3) launch<E4M3, E4M3, MODE>(args, a_map, b_map, sms, stream);
  else if (a == E4M3) launch<E4M3, E5M2, MODE>(args, a_map, b_map, sms, stream);
  else if (b == E4M3) launch<E5M2, E4M3, MODE>(args, a_map, b_map, sms, stream);
  else launch<E5M2, E5M2, MODE>(args, a_map, b_map, sms, stream);
}

int element(const at::Tensor& codes) { return codes.scalar_type() == at::kFloat8_e5m2 ? E5M2 : E4M3; }

// The launch shared by both products: their tiles over every SM, one CTA an SM.
void run(Args args, const at::Tensor& a, const at::Tensor& b, const CUtensorMap& a_map, const CUtensorMap& b_map, int64_t mode) {
  const auto* properties = at::cuda::getDeviceProperties(a.get_device());
  TORCH_CHECK(properties->major == 9 && properties->minor == 0,
              "graphquant.grouped_fp8_gemm runs on sm_90 (Hopper's wgmma) alone, not on sm_", properties->major, properties->minor);
  const int sms = properties->multiProcessorCount;
  auto stream = at::cuda::getCurrentCUDAStream();
  const int ea = element(a), eb = element(b);
  if (mode == FAST) launch_elements<FAST>(args, ea, eb, a_map, b_map, sms, stream);
  else if (mode == PROMOTED) launch_elements<PROMOTED>(args, ea, eb, a_map, b_map, sms, stream);
  else launch_elements<BLOCK>(args, ea, eb, a_map, b_map, sms, stream);
}

void check_common(const at::Tensor& a, const at::Tensor& b, const at::Tensor& ends, at::ScalarType out_dtype, int64_t mode) {
  check_codes(a, "A");
  check_codes(b, "B");
  TORCH_CHECK(a.device() == b.device() && ends.device() == a.device() && ends.scalar_type() == at::kInt && ends.dim() == 1 &&
                  ends.is_contiguous() && ends.numel() >= 1,
              "graphquant.grouped_fp8_gemm: A, B and the groups' int32 ends must lie on one device; got ", a.device(), ", ", b.device(),
              " and ", ends.scalar_type(), " ", ends.sizes(), " on ", ends.device());
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kHalf || out_dtype == at::kFloat,
              "graphquant.grouped_fp8_gemm writes bfloat16, float16 or float32, not ", out_dtype);
  TORCH_CHECK(mode == FAST || mode == PROMOTED || mode == BLOCK, "graphquant.grouped_fp8_gemm: mode is 0 (fast), 1 (promoted) or 2 (block ",
              "scales), not ", mode);
}

// tokens x experts: out (tokens, n), row source[r] = A[r] @ B_g^T. B: an expert stack, rowwise
// (groups * n', k) or columnwise, stored transposed (n, groups * n'); per_group: n'.
at::Tensor tokens_by_experts(const at::Tensor& a, const at::Tensor& b, bool b_rowwise, int64_t n, int64_t tokens, const at::Tensor& row_group,
                             const at::Tensor& source, const at::Tensor& ends, const at::Tensor& a_scale, const std::vector<int64_t>& a_layout,
                             const at::Tensor& b_scale, const std::vector<int64_t>& b_layout, int64_t mode, at::ScalarType out_dtype) {
  check_common(a, b, ends, out_dtype, mode);
  TORCH_CHECK(mode != BLOCK || (a_layout.size() == 4 && b_layout.size() == 4 && a_layout[3] == 1 && b_layout[3] == TILE),
              "graphquant.grouped_fp8_gemm: block scales are A's 1x128 by B's 128x128 (DeepSeek-V3's fprop and dgrad)");
  const int64_t groups = ends.numel(), rows = a.size(0), k = a.size(1);
  const int64_t stack = b_rowwise ? b.size(0) : b.size(1);
  TORCH_CHECK(stack % groups == 0, "graphquant.grouped_fp8_gemm: B's stack of ", stack, " rows does not split into ", groups, " experts");
  const int64_t per_group = stack / groups;
  const int64_t b_k = b_rowwise ? b.size(1) : per_group, b_n = b_rowwise ? per_group : b.size(0);
  TORCH_CHECK(b_k == k && n <= b_n && rows % TILE == 0, "graphquant.grouped_fp8_gemm multiplies A (padded rows, k) in tiles of ", TILE,
              " rows by each expert's B (n', k), n <= n'; got A ", a.sizes(), ", B ", b.sizes(), (b_rowwise ? " rowwise" : " columnwise"),
              " of ", groups, " experts and n = ", n);
  TORCH_CHECK(b_rowwise || per_group % 16 == 0, "graphquant.grouped_fp8_gemm: a columnwise expert stack's experts must start at multiples ",
              "of 16 bytes (TMA), got ", per_group, " columns an expert");
  TORCH_CHECK(row_group.scalar_type() == at::kLong && source.scalar_type() == at::kLong && row_group.numel() == rows &&
                  source.numel() == rows && row_group.is_contiguous() && source.is_contiguous(),
              "graphquant.grouped_fp8_gemm: row_group and source must be contiguous int64 of A's ", rows, " padded rows");
  const c10::cuda::CUDAGuard guard(a.device());
  auto out = at::empty({tokens, n}, a.options().dtype(out_dtype));
  if (tokens == 0 || n == 0) return out;
  if (k == 0) return out.zero_();
  const Args args{out.data_ptr(),   row_group.data_ptr<int64_t>(), source.data_ptr<int64_t>(), ends.data_ptr<int32_t>(),
                  scales_of(a_scale, a_layout, a, "A"), scales_of(b_scale, b_layout, b, "B"),
                  static_cast<int>(groups), 0, static_cast<int>(n), static_cast<int>((k + TILE - 1) / TILE),
                  static_cast<int>(rows / TILE), static_cast<int>((n + TILE - 1) / TILE), kind(out_dtype), false};
  const CUtensorMap a_map = tensor_map("graphquant.grouped_fp8_gemm", a.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, rows, k, a.stride(0),
                                       TILE, TILE, CU_TENSOR_MAP_SWIZZLE_128B);
  // (K, n', groups), innermost first: each expert's edges zero-filled, not read from the next one.
  const int64_t dims[3] = {b_k, b_n, groups};
  const int64_t strides[2] = {b.stride(0), b_rowwise ? per_group * b.stride(0) : per_group};
  const int box[3] = {TILE, TILE, 1};
  const CUtensorMap b_map = tensor_map("graphquant.grouped_fp8_gemm", b.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 3, dims, strides, box,
                                       CU_TENSOR_MAP_SWIZZLE_128B);
  run(args, a, b, a_map, b_map, mode);
  return out;
}

// tokens x tokens: out (groups, m, n), out[g] = A_g B_g^T over group g's padded rows, A (m', rows)
// and B (n, rows) stored with the rows contiguous; A's first m rows.
at::Tensor tokens_by_tokens(const at::Tensor& a, const at::Tensor& b, int64_t m, const at::Tensor& ends, const at::Tensor& a_scale,
                            const std::vector<int64_t>& a_layout, const at::Tensor& b_scale, const std::vector<int64_t>& b_layout, int64_t mode,
                            at::ScalarType out_dtype) {
  check_common(a, b, ends, out_dtype, mode);
  TORCH_CHECK(mode != BLOCK, "graphquant.grouped_fp8_gemm: tokens x tokens takes per-tensor and per-row scales, not block scales");
  const int64_t groups = ends.numel(), n = b.size(0), rows = a.size(1);
  TORCH_CHECK(b.size(1) == rows && m <= a.size(0) && rows % TILE == 0,
              "graphquant.grouped_fp8_gemm multiplies A (m', padded rows) by B (n, padded rows) over groups of whole ", TILE,
              "-row tiles, m <= m'; got A ", a.sizes(), ", B ", b.sizes(), " and m = ", m);
  const c10::cuda::CUDAGuard guard(a.device());
  auto out = at::empty({groups, m, n}, a.options().dtype(out_dtype));
  if (m == 0 || n == 0) return out;
  const Args args{out.data_ptr(), nullptr, nullptr, ends.data_ptr<int32_t>(), scales_of(a_scale, a_layout, a, "A"),
                  scales_of(b_scale, b_layout, b, "B"), static_cast<int>(groups), static_cast<int>(m), static_cast<int>(n), 0,
                  static_cast<int>((m + TILE - 1) / TILE), static_cast<int>((n + TILE - 1) / TILE), kind(out_dtype), true};
  const CUtensorMap a_map = tensor_map("graphquant.grouped_fp8_gemm", a.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, a.size(0), rows,
                                       a.stride(0), TILE, TILE, CU_TENSOR_MAP_SWIZZLE_128B);
  const int64_t dims[3] = {rows, n, 1};
  const int64_t strides[2] = {b.stride(0), n * b.stride(0)};
  const int box[3] = {TILE, TILE, 1};
  const CUtensorMap b_map = tensor_map("graphquant.grouped_fp8_gemm", b.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 3, dims, strides, box,
                                       CU_TENSOR_MAP_SWIZZLE_128B);
  run(args, a, b, a_map, b_map, mode);
  return out;
}

}  // namespace
}  // namespace gq

void register_grouped_gemm(pybind11::module_& m) {
  m.def("grouped_fp8_tokens_by_experts", &gq::tokens_by_experts,
        "out (tokens, n): row source[r] = A[r] @ B_g^T for the padded rows r of group g (row_group), FP8 codes on sm_90's tensor cores; "
        "B an expert stack, rowwise (groups * n', k) or columnwise (n, groups * n'); scales as (tensor, [group, row, block strides, rows "
        "a scale]); mode 0 fast, 1 promoted every 128 products, 2 DeepSeek-V3's block scales",
        pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("b_rowwise"), pybind11::arg("n"), pybind11::arg("tokens"),
        pybind11::arg("row_group"), pybind11::arg("source"), pybind11::arg("ends"), pybind11::arg("a_scale"), pybind11::arg("a_layout"),
        pybind11::arg("b_scale"), pybind11::arg("b_layout"), pybind11::arg("mode"), pybind11::arg("out_dtype"));
  m.def("grouped_fp8_tokens_by_tokens", &gq::tokens_by_tokens,
        "out (groups, m, n): A_g B_g^T over group g's padded rows (ends), A (m', rows) and B (n, rows) FP8 codes with the rows "
        "contiguous; per-tensor or per-row scales as (tensor, [group, row, block strides, rows a scale]); mode 0 fast, 1 promoted",
        pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("m"), pybind11::arg("ends"), pybind11::arg("a_scale"), pybind11::arg("a_layout"),
        pybind11::arg("b_scale"), pybind11::arg("b_layout"), pybind11::arg("mode"), pybind11::arg("out_dtype"));
}
