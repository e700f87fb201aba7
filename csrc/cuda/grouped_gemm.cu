// graphquant._C.grouped_fp8_tokens_by_experts / _tokens_by_tokens: the promoted FP8 grouped GEMMs
// of an MoE layer's experts on Hopper. Tokens x experts (fprop, dgrad): out[source[r]] = A[r] @
// B_g^T for the padded rows r of each group g (graphquant.formats.groups' layout: every group starts
// at a multiple of 128 rows, so a tile of 128 rows lies in one group), B an expert stack read as
// (groups, n', K) by a 3-D TMA descriptor. Tokens x tokens (wgrad): out[g] = A_g B_g^T over group
// g's padded rows, its K. Every group's product in one persistent launch, the group offsets read on
// the device. The Triton grouped GEMM (graphquant.kernels.triton_grouped_fp8) waits for each K
// tile's wgmmas before it promotes them and no other warps keep the tensor cores busy meanwhile;
// here a warpgroup copies the operands by TMA and two multiply, one promoting while the other's
// wgmmas run, and each quad of lanes writes its rows in 16-byte runs (benchmarks/NOTES.md,
// grouped_gemm.py, has where it stands: ahead of the Triton kernel's products even where those
// leave the sums in the tensor cores' accumulator).
//
// Numerics: the Triton kernel's, bit for bit. Each 128-long K block's products are summed on the
// FP8 tensor cores (four m64n128k32 wgmmas a half of the tile); PROMOTED adds each block's partial
// sum into fp32 (fp8.PROMOTED_PRODUCTS), BLOCK adds it times its two block scales (DeepSeek-V3's
// 1x128 A by 128x128 B), BLOCK_COLUMNS times A's row's by B's column's (1x128 both: the weight
// gradient's), fma(partial, a's x b's, acc). Per-tensor and per-row factors multiply the fp32 sum
// once, acc * (a's x b's); one rounding to the output's dtype.
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

// A CTA's output tile is TILE rows by HALVES * TILE columns (L2's bandwidth held 128 x 128 FP8
// tiles near bf16's speed: a stage's 32 KB a 4.2 MFLOP); a stage holds TILE of K of both operands,
// 128 bytes a row (one swizzle atom row).
constexpr int TILE = 128, HALVES = 2, TILE_N = HALVES * TILE;
constexpr int PRODUCERS = 128, CONSUMERS = 256, THREADS = PRODUCERS + CONSUMERS;  // a warpgroup copying, two multiplying
constexpr int STAGE_BYTES = (TILE + TILE_N) * TILE;
constexpr int STAGES = 4;
// Each multiplying warpgroup's two buffers of column scales, one read while the next is filled:
// BLOCK_COLUMNS' of a K block, PROMOTED's column factors of a tile.
constexpr int COLUMN_SCALE_BYTES = 2 * 2 * TILE_N * 4;
// + two barriers a stage, + the column scales, + the base's alignment to 1024
constexpr int SMEM = STAGES * (STAGE_BYTES + 16) + COLUMN_SCALE_BYTES + 1024;
constexpr int BAND = 16;  // tile rows walked a column at a time
enum Mode { PROMOTED = 1, BLOCK = 2, BLOCK_COLUMNS = 3 };  // graphquant.kernels.grouped_fp8's

// Where an operand's scales lie (graphquant.kernels.grouped_operands.Scales): GEMM row i of group g
// in K block kb scaled by tensor[g * group + (i / ROWS) * row + kb * block], ROWS the rows a scale
// spans as the mode fixes them (the host checks the layout against it): 1 for per-row factors and
// 1x128 blocks, TILE for B's 128x128 ones; per-tensor and per-row factors have no K block.
struct Scales {
  const float* tensor;
  int64_t group, row, block;
  template <int ROWS>
  __device__ __forceinline__ float block_scale(int64_t g, int64_t i, int64_t kb) const { return tensor[g * group + i / ROWS * row + kb * block]; }
  __device__ __forceinline__ float factor(int64_t g, int64_t i) const { return tensor[g * group + i * row]; }
};

struct Args {
  void* out;
  const int64_t* row_group;  // tokens x experts: each padded row's group
  const int64_t* source;     // tokens x experts: the output row of each padded row, -1 for a pad row
  const int32_t* ends;       // each group's cumulative padded end
  Scales a_scale, b_scale;
  int groups, m, n, k_blocks, m_tiles, n_tiles, out_kind;  // m, m_tiles: tokens x tokens'; k_blocks: tokens x experts'
  bool tokens_by_tokens;
};

// What one output tile multiplies: its group, tile row and column, its first K (A's and B's
// column) and number of K blocks.
struct Work {
  int group, tm, tn, k0, blocks;
};

__device__ __forceinline__ Work work_of(const Args& args, int tile, int m_tiles) {
  Work w;
  if (args.tokens_by_tokens) {
    const int per_group = m_tiles * args.n_tiles;
    w.group = tile / per_group;
    tile_in_bands<BAND>(tile % per_group, m_tiles, args.n_tiles, w.tm, w.tn);
    w.k0 = w.group == 0 ? 0 : args.ends[w.group - 1];
    w.blocks = (args.ends[w.group] - w.k0) / TILE;
  } else {
    tile_in_bands<BAND>(tile, m_tiles, args.n_tiles, w.tm, w.tn);
    w.group = static_cast<int>(args.row_group[static_cast<int64_t>(w.tm) * TILE]);
    w.k0 = 0;
    w.blocks = args.k_blocks;
  }
  return w;
}

// Where a thread's sums of a tile go and its rows' per-tensor or per-row factors (none under block scales),
// read when the tile starts, so that the loads' latency hides behind its products.
template <int MODE>
struct Epilogue {
  int64_t out_row[2];  // -1: not stored
  float row_factor[2];

  __device__ __forceinline__ Epilogue(const Args& args, const Work& w, const int (&rows)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = w.tm * TILE + rows[h];
      if (args.tokens_by_tokens) {
        out_row[h] = row < args.m ? (static_cast<int64_t>(w.group) * args.m + row) * args.n : -1;
      } else {
        const int64_t source = args.source[static_cast<int64_t>(row)];
        out_row[h] = source < 0 ? -1 : source * args.n;
      }
      row_factor[h] = MODE != PROMOTED || out_row[h] < 0 ? 1.f : args.a_scale.factor(args.tokens_by_tokens ? w.group : 0, row);
    }
  }
};

// A thread's sums of one half of the tile (sum 4j + 2r + b: tile row rows[r], column n0 + 8j + 2t
// + b) times their factors, acc * (a's x b's), rounded once into the output; ``columns``: the
// half's column factors (PROMOTED), staged in shared memory while the tile multiplied. Where the
// half lies whole in rows aligned to 16 bytes, each quad of lanes trades its pairs so that a lane
// writes 8 adjacent columns at once (whole sectors, a quarter of the stores); else pair by pair.
template <typename Out, int MODE>
__device__ __forceinline__ void store_half(const float (&acc)[64], const Args& args, int n0, int t, const Epilogue<MODE>& e, const float* columns) {
  Out* out = static_cast<Out*>(args.out);
  const auto value = [&](int i, int r) { return MODE == PROMOTED ? acc[i] * (e.row_factor[r] * columns[8 * (i / 4) + 2 * t + i % 2]) : acc[i]; };
  if (args.n % 8 == 0 && n0 + TILE <= args.n) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // blocks 4q .. 4q + 3: lane t writes block 4q + t
        Out* p = out + e.out_row[r] + n0 + 32 * q + 8 * t;
        if constexpr (sizeof(Out) == 2) {
          uint32_t w[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) w[u] = packed_pair<Out>(value(16 * q + 4 * u + 2 * r, r), value(16 * q + 4 * u + 2 * r + 1, r));
          quad_transpose(w, t);
          if (e.out_row[r] >= 0) *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
        } else {
          uint32_t x[4], y[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            x[u] = __float_as_uint(value(16 * q + 4 * u + 2 * r, r));
            y[u] = __float_as_uint(value(16 * q + 4 * u + 2 * r + 1, r));
          }
          quad_transpose(x, t);
          quad_transpose(y, t);
          if (e.out_row[r] >= 0) {
            reinterpret_cast<uint4*>(p)[0] = make_uint4(x[0], y[0], x[1], y[1]);
            reinterpret_cast<uint4*>(p)[1] = make_uint4(x[2], y[2], x[3], y[3]);
          }
        }
      }
    }
    return;
  }
  const bool even = args.n % 2 == 0;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int column = n0 + 8 * j + 2 * t;
    if (column >= args.n) continue;
    const bool both = column + 1 < args.n;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (e.out_row[r] < 0) continue;
      Out* p = out + e.out_row[r] + column;
      store_pair(p, value(4 * j + 2 * r, r), value(4 * j + 2 * r + 1, r), both && even);
      if (both && !even) store_value(p + 1, value(4 * j + 2 * r + 1, r));
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
  float* const column_scales = reinterpret_cast<float*>(raw + (base - smem_address(raw)) + STAGES * (STAGE_BYTES + 16));
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      barrier_init(full + 8 * s, 1);
      barrier_init(empty + 8 * s, CONSUMERS / 32);  // an arrival a consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // tokens x experts: the rows of tiles up to the last group's end, read on the device; tokens x
  // tokens: every group's tiles.
  const int m_tiles = args.tokens_by_tokens ? args.m_tiles : (args.ends[args.groups - 1] + TILE - 1) / TILE;
  const int tiles = (args.tokens_by_tokens ? args.groups : 1) * m_tiles * args.n_tiles;

  if (tid < PRODUCERS) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (tid == 0) {
      int j = 0;  // stages filled so far, over every tile
      for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const Work w = work_of(args, tile, m_tiles);
        for (int block = 0; block < w.blocks; ++block, ++j) {
          const int s = j % STAGES;
          if (j >= STAGES) barrier_wait(empty + 8 * s, (j / STAGES - 1) & 1);
          const uint32_t stage = base + s * STAGE_BYTES, bar = full + 8 * s;
          const int k = w.k0 + block * TILE;
          expect_bytes(bar, STAGE_BYTES);
          tma_load(stage, a_map, k, w.tm * TILE, bar);
          tma_load(stage + TILE * TILE, b_map, k, w.tn * TILE_N, args.tokens_by_tokens ? 0 : w.group, bar);
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
    int j = 0, tiles_done = 0;  // stages consumed and tiles multiplied so far
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      const Work w = work_of(args, tile, m_tiles);
      const Epilogue<MODE> epilogue(args, w, rows);
      float acc[HALVES][64], partial[64];
#pragma unroll
      for (int h = 0; h < HALVES; ++h) {
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[h][i] = 0.f;
      }
      // Block scales: each block's (A's of this thread's rows; B's 128x128 tile of each half, or the
      // columns this thread stages for its warpgroup) read while the block before it multiplies.
      const int kb0 = w.k0 / TILE, staging = consumer % 128;
      float tile_scale[HALVES] = {1.f, 1.f}, row_scale[2] = {0.f, 0.f}, staged[2] = {0.f, 0.f};
      float* const warpgroup_scales = column_scales + warpgroup * 2 * TILE_N;
      // PROMOTED: this thread's two of the tile's column factors, read now for the epilogue.
      float held_factor[2] = {1.f, 1.f};
      if constexpr (MODE == PROMOTED) {
        for (int s = 0; s < 2; ++s) held_factor[s] = args.b_scale.factor(w.group, min(w.tn * TILE_N + staging + 128 * s, args.n - 1));
      }
      const auto read_scales = [&](int64_t kb) {
        if constexpr (MODE == BLOCK) {
          for (int h = 0; h < HALVES; ++h) tile_scale[h] = args.b_scale.block_scale<TILE>(w.group, min(w.tn * TILE_N + h * TILE, args.n - 1), kb);
        }
        if constexpr (MODE == BLOCK_COLUMNS) {
          for (int s = 0; s < 2; ++s) staged[s] = args.b_scale.block_scale<1>(w.group, min(w.tn * TILE_N + staging + 128 * s, args.n - 1), kb);
        }
        for (int r = 0; r < 2; ++r) {
          const int row = w.tm * TILE + rows[r];  // tokens x tokens: A's rows past m are not stored, nor their scales read
          row_scale[r] = args.a_scale.block_scale<1>(0, args.tokens_by_tokens ? min(row, args.m - 1) : row, kb);
        }
      };
      // BLOCK_COLUMNS: the staged column scales written to a buffer once every thread of the warpgroup has read what it held.
      const auto publish = [&](int buffer) {
        for (int s = 0; s < 2; ++s) warpgroup_scales[buffer * TILE_N + staging + 128 * s] = staged[s];
        named_barrier_sync(1 + warpgroup, 128);
      };
      if constexpr (MODE != PROMOTED) {
        if (w.blocks > 0) read_scales(kb0);  // an empty group's (tokens x tokens) K block may lie past the scales
      }
      if constexpr (MODE == BLOCK_COLUMNS) {
        named_barrier_sync(1 + warpgroup, 128);  // the tile before's reads of buffer 0 done
        publish(0);
      }
      for (int block = 0; block < w.blocks; ++block, ++j) {
        const int s = j % STAGES;
        const uint32_t a_stage = base + s * STAGE_BYTES + warpgroup * 64 * TILE, b_stage = base + s * STAGE_BYTES + TILE * TILE;
        barrier_wait(full + 8 * s, (j / STAGES) & 1);
        float factor[HALVES][2];
#pragma unroll
        for (int h = 0; h < HALVES; ++h) {
#pragma unroll
          for (int r = 0; r < 2; ++r) factor[h][r] = row_scale[r] * tile_scale[h];
        }
        if constexpr (MODE != PROMOTED) {
          if (block + 1 < w.blocks) read_scales(kb0 + block + 1);
        }
        // Each half's partial sum promoted in turn (both at once would take 256 registers a thread).
#pragma unroll
        for (int h = 0; h < HALVES; ++h) {
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) {
            Fp8Wgmma<A, B>::mma(partial, descriptor(a_stage + 32 * kk), descriptor(b_stage + h * TILE * TILE + 32 * kk), kk);
          }
          wgmma_commit();
          wgmma_wait<0>();
          keep(partial);
          if (h == HALVES - 1 && lane == 0) barrier_arrive(empty + 8 * s);  // the stage read: the producer may fill it again
          if constexpr (MODE == PROMOTED) {
#pragma unroll
            for (int i = 0; i < 64; ++i) acc[h][i] += partial[i];
          } else if constexpr (MODE == BLOCK) {
#pragma unroll
            for (int i = 0; i < 64; ++i) acc[h][i] = fmaf(partial[i], factor[h][(i >> 1) & 1], acc[h][i]);
          } else {
            // sum 4j + 2r + b: row r's scale times column 8j + 2t + b's.
            const float* columns = warpgroup_scales + (block % 2) * TILE_N + h * TILE + 2 * t;
#pragma unroll
            for (int jj = 0; jj < 16; ++jj) {
              const float2 c = *reinterpret_cast<const float2*>(columns + 8 * jj);
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                acc[h][4 * jj + 2 * r] = fmaf(partial[4 * jj + 2 * r], factor[h][r] * c.x, acc[h][4 * jj + 2 * r]);
                acc[h][4 * jj + 2 * r + 1] = fmaf(partial[4 * jj + 2 * r + 1], factor[h][r] * c.y, acc[h][4 * jj + 2 * r + 1]);
              }
            }
          }
        }
        if constexpr (MODE == BLOCK_COLUMNS) {
          if (block + 1 < w.blocks) publish((block + 1) % 2);
        }
      }
      // PROMOTED: the column factors shared through one of the warpgroup's two buffers, a tile's
      // in turn (its barrier a tile keeps a buffer from being written while the tile before reads it).
      float* const columns = warpgroup_scales + (tiles_done++ % 2) * TILE_N;
      if constexpr (MODE == PROMOTED) {
        for (int s = 0; s < 2; ++s) columns[staging + 128 * s] = held_factor[s];
        named_barrier_sync(1 + warpgroup, 128);
      }
#pragma unroll
      for (int h = 0; h < HALVES; ++h) {
        const int n0 = w.tn * TILE_N + h * TILE;
        if (args.out_kind == BF16) store_half<__nv_bfloat16, MODE>(acc[h], args, n0, t, epilogue, columns + h * TILE);
        else if (args.out_kind == F16) store_half<__half, MODE>(acc[h], args, n0, t, epilogue, columns + h * TILE);
        else store_half<float, MODE>(acc[h], args, n0, t, epilogue, columns + h * TILE);
      }
    }
  }
#endif
}

Scales scales_of(const at::Tensor& tensor, const std::vector<int64_t>& layout, const at::Tensor& codes, const char* name) {
  TORCH_CHECK(tensor.scalar_type() == at::kFloat && tensor.device() == codes.device() && layout.size() == 4 && layout[3] >= 1,
              "graphquant.grouped_fp8_gemm: ", name, "'s scales must be float32 on ", codes.device(),
              " with a layout (group, row, block strides, rows a scale); got ", tensor.scalar_type(), " on ", tensor.device(), " and ",
              layout.size(), " layout values");
  return Scales{tensor.data_ptr<float>(), layout[0], layout[1], layout[2]};
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

// out (tokens, n), row source[r] = A[r] @ B_g^T. B: an expert stack, rowwise (groups * n', k) or
// columnwise, stored transposed (n, groups * n'); per_group: n'.
// Checks both products share: the operands, the ends, the output's dtype, the mode and the scales' layouts.
void check_call(const at::Tensor& a, const at::Tensor& b, const at::Tensor& ends, const std::vector<int64_t>& a_layout,
                const std::vector<int64_t>& b_layout, int64_t mode, at::ScalarType out_dtype) {
  check_fp8_codes(a, "graphquant.grouped_fp8_gemm", "A");
  check_fp8_codes(b, "graphquant.grouped_fp8_gemm", "B");
  TORCH_CHECK(a.device() == b.device() && ends.device() == a.device() && ends.scalar_type() == at::kInt && ends.dim() == 1 &&
                  ends.is_contiguous() && ends.numel() >= 1,
              "graphquant.grouped_fp8_gemm: A, B and the groups' int32 ends must lie on one device; got ", a.device(), ", ", b.device(),
              " and ", ends.scalar_type(), " ", ends.sizes(), " on ", ends.device());
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kHalf || out_dtype == at::kFloat,
              "graphquant.grouped_fp8_gemm writes bfloat16, float16 or float32, not ", out_dtype);
  TORCH_CHECK(mode == PROMOTED || mode == BLOCK || mode == BLOCK_COLUMNS,
              "graphquant.grouped_fp8_gemm: mode is 1 (promoted), 2 (block scales, B's 128x128) or 3 (block scales, B's 1x128), not ", mode);
  TORCH_CHECK(a_layout.size() == 4 && b_layout.size() == 4 && a_layout[3] == 1 && b_layout[3] == (mode == BLOCK ? TILE : 1),
              "graphquant.grouped_fp8_gemm: block scales are A's 1x128 by B's 128x128 (mode 2: DeepSeek-V3's fprop and dgrad) or 1x128 "
              "(mode 3: its wgrad), per-tensor and per-row factors one a GEMM row of each operand");
  const auto* properties = at::cuda::getDeviceProperties(a.get_device());
  TORCH_CHECK(properties->major == 9 && properties->minor == 0,
              "graphquant.grouped_fp8_gemm runs on sm_90 (Hopper's wgmma) alone, not on sm_", properties->major, properties->minor);
}

// A's map (rows, K), in 128 x 128 tiles, and B's as (K, n', groups), innermost first, so that each
// group's edges are zero-filled rather than read from the next one; then the mode's kernel.
void launch_mode(const Args& args, const at::Tensor& a, const at::Tensor& b, int64_t b_k, int64_t b_n, int64_t b_groups,
                 int64_t b_group_stride, int64_t mode) {
  const CUtensorMap a_map = tensor_map("graphquant.grouped_fp8_gemm", a.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, a.size(0), a.size(1),
                                       a.stride(0), TILE, TILE, CU_TENSOR_MAP_SWIZZLE_128B);
  const int64_t dims[3] = {b_k, b_n, b_groups};
  const int64_t strides[2] = {b.stride(0), b_group_stride};
  const int box[3] = {TILE, TILE_N, 1};
  const CUtensorMap b_map = tensor_map("graphquant.grouped_fp8_gemm", b.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 3, dims, strides, box,
                                       CU_TENSOR_MAP_SWIZZLE_128B);
  const int sms = at::cuda::getDeviceProperties(a.get_device())->multiProcessorCount;
  auto stream = at::cuda::getCurrentCUDAStream();
  if (mode == PROMOTED) launch_elements<PROMOTED>(args, fp8_element(a), fp8_element(b), a_map, b_map, sms, stream);
  else if (mode == BLOCK) launch_elements<BLOCK>(args, fp8_element(a), fp8_element(b), a_map, b_map, sms, stream);
  else launch_elements<BLOCK_COLUMNS>(args, fp8_element(a), fp8_element(b), a_map, b_map, sms, stream);
}

// tokens x experts: out (tokens, n), row source[r] = A[r] @ B_g^T. B: an expert stack, rowwise
// (groups * n', k) or columnwise, stored transposed (n, groups * n'); per_group: n'.
at::Tensor tokens_by_experts(const at::Tensor& a, const at::Tensor& b, bool b_rowwise, int64_t n, int64_t tokens, const at::Tensor& row_group,
                             const at::Tensor& source, const at::Tensor& ends, const at::Tensor& a_scale, const std::vector<int64_t>& a_layout,
                             const at::Tensor& b_scale, const std::vector<int64_t>& b_layout, int64_t mode, at::ScalarType out_dtype) {
  check_call(a, b, ends, a_layout, b_layout, mode, out_dtype);
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
  const Args args{out.data_ptr(),
                  row_group.data_ptr<int64_t>(),
                  source.data_ptr<int64_t>(),
                  ends.data_ptr<int32_t>(),
                  scales_of(a_scale, a_layout, a, "A"),
                  scales_of(b_scale, b_layout, b, "B"),
                  static_cast<int>(groups),
                  0,
                  static_cast<int>(n),
                  static_cast<int>((k + TILE - 1) / TILE),
                  0,
                  static_cast<int>((n + TILE_N - 1) / TILE_N),
                  kind(out_dtype),
                  false};
  launch_mode(args, a, b, b_k, b_n, groups, b_rowwise ? per_group * b.stride(0) : per_group, mode);
  return out;
}

// tokens x tokens: out (groups, m, n), out[g] = A_g B_g^T over group g's padded rows (an empty
// group: 0), A (m', rows) and B (n, rows) stored with the rows contiguous; A's first m rows.
at::Tensor tokens_by_tokens(const at::Tensor& a, const at::Tensor& b, int64_t m, const at::Tensor& ends, const at::Tensor& a_scale,
                            const std::vector<int64_t>& a_layout, const at::Tensor& b_scale, const std::vector<int64_t>& b_layout, int64_t mode,
                            at::ScalarType out_dtype) {
  check_call(a, b, ends, a_layout, b_layout, mode, out_dtype);
  TORCH_CHECK(mode != BLOCK, "graphquant.grouped_fp8_gemm: tokens x tokens takes per-tensor and per-row factors or 1x128 block scales, not 128x128 ones");
  const int64_t groups = ends.numel(), n = b.size(0), rows = a.size(1);
  TORCH_CHECK(b.size(1) == rows && m <= a.size(0) && rows % TILE == 0,
              "graphquant.grouped_fp8_gemm multiplies A (m', padded rows) by B (n, padded rows) over groups of whole ", TILE,
              "-row tiles, m <= m'; got A ", a.sizes(), ", B ", b.sizes(), " and m = ", m);
  const c10::cuda::CUDAGuard guard(a.device());
  auto out = at::empty({groups, m, n}, a.options().dtype(out_dtype));
  if (m == 0 || n == 0) return out;
  const Args args{out.data_ptr(),
                  nullptr,
                  nullptr,
                  ends.data_ptr<int32_t>(),
                  scales_of(a_scale, a_layout, a, "A"),
                  scales_of(b_scale, b_layout, b, "B"),
                  static_cast<int>(groups),
                  static_cast<int>(m),
                  static_cast<int>(n),
                  0,
                  static_cast<int>((m + TILE - 1) / TILE),
                  static_cast<int>((n + TILE_N - 1) / TILE_N),
                  kind(out_dtype),
                  true};
  launch_mode(args, a, b, rows, n, 1, n * b.stride(0), mode);  // B as one group: each tile reads its own group's K range
  return out;
}

}  // namespace
}  // namespace gq

void register_grouped_gemm(pybind11::module_& m) {
  m.def("grouped_fp8_tokens_by_experts", &gq::tokens_by_experts,
        "out (tokens, n): row source[r] = A[r] @ B_g^T for the padded rows r of group g (row_group), FP8 codes on sm_90's tensor cores; "
        "B an expert stack, rowwise (groups * n', k) or columnwise (n, groups * n'); scales as (tensor, [group, row, block strides, rows "
        "a scale]); mode 1: sums promoted every 128 products, per-tensor or per-row factors after; 2: DeepSeek-V3's block scales (B's "
        "128x128); 3: 1x128 block scales on both sides",
        pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("b_rowwise"), pybind11::arg("n"), pybind11::arg("tokens"),
        pybind11::arg("row_group"), pybind11::arg("source"), pybind11::arg("ends"), pybind11::arg("a_scale"), pybind11::arg("a_layout"),
        pybind11::arg("b_scale"), pybind11::arg("b_layout"), pybind11::arg("mode"), pybind11::arg("out_dtype"));
  m.def("grouped_fp8_tokens_by_tokens", &gq::tokens_by_tokens,
        "out (groups, m, n): A_g B_g^T over group g's padded rows (ends), A (m', rows) and B (n, rows) FP8 codes with the rows "
        "contiguous; scales as (tensor, [group, row, block strides, rows a scale]); mode 1: per-tensor or per-row factors, sums promoted; "
        "3: 1x128 block scales on both sides (DeepSeek-V3's wgrad)",
        pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("m"), pybind11::arg("ends"), pybind11::arg("a_scale"), pybind11::arg("a_layout"),
        pybind11::arg("b_scale"), pybind11::arg("b_layout"), pybind11::arg("mode"), pybind11::arg("out_dtype"));
}
