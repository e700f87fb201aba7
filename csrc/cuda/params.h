// Plain-data parameters of the kernels and the host-side launch functions (no torch, no CUDA
// types), shared by the kernels, the ATen glue in register.cpp and the CPU test build.
#pragma once

#include <algorithm>
#include <cstdint>

namespace gq {

// Formats of one direction of the tile kernel (register.cpp reads them by the names of
// graphquant.quantizers.KernelEncoding.scaling).
enum Format { kNone = 0, kPerTensor = 1, kBlock = 2, kRowScaled = 3, kMX = 4, kNV = 5, kNumFormats = 6 };
enum InDtype { kBF16 = 0, kF16 = 1, kF32 = 2 };

// One direction's encoder: its options, the scales it reads and the outputs it writes.
struct Encoder {
  int fp8 = 0;         // Fp8Kind
  float epsilon = 0;   // FP8 block: amax floor
  int pow2 = 0;        // FP8 block: power-of-two scales
  int two_d = 0;       // FP8 block 128x128, NVFP4 16x16
  int block_chunks = 8;  // FP8 block otherwise: the 16-element chunks one spans along its dim (1, 2, 4 or 8)
  int transposed = 0;    // column side: data stored (K, M); MXFP8 and some FP8 blocks keep x's (M, K)
  int sr = 0;          // NVFP4 stochastic rounding
  int row_scaled = 0;  // NVFP4 rowwise: one global amax per row
  uint32_t key = 0;    // NVFP4 stochastic rounding: the stream's key, unless rng is given
  const int64_t* rng = nullptr;  // ... or [seed, step] on the device, the key made from it there
  int64_t rng_offset = 0;        //     with offset step * kStreamsPerStep + rng_offset
  int key_stream = 0;            //     and stream 0 (rowwise) or 1 (columnwise)
  const float* scale = nullptr;      // per-tensor: per group; row-scaled FP8: per row or column
  const float* scale_inv = nullptr;  // the same, inverted (for the dequantized source)
  const uint32_t* amax = nullptr;    // NVFP4: the global amax per group, or per row (float bits)
  uint8_t* data = nullptr;
  void* scales = nullptr;  // block scales: float, E8M0 bytes or E4M3 bytes
};

// Amax accumulators (float bits, max-reduced); null when not wanted.
struct Accumulators {
  uint32_t* row_global = nullptr;  // max |x| per group
  uint32_t* rows = nullptr;        // max |x| per row
  uint32_t* col_global = nullptr;  // max |source| per group, after the column transform
  uint32_t* cols = nullptr;        // max |source| per column
};

struct TileParams {
  const void* x = nullptr;
  int64_t M = 0, K = 0;
  int vec_load = 0;       // rows of x are 16-byte aligned: load 16 bytes at a time
  int main = 1;           // 0: a pre-pass that only accumulates amaxes
  int dq_source = 0;      // the column side reads the dequantized rowwise values
  int col_rht = 0;        // column chunks go through the random Hadamard transform
  int col_sign_mask = 0;  // ... with the random sign mask
  Encoder row, col;
  Accumulators acc;
  const int64_t* group_start = nullptr;  // G + 1 prefix sums of the group sizes (null: one group)
  // A padded layout's 128-row tiles (graphquant.formats.groups.tile_runs): tile i's rows are x's
  // rows runs[2i], runs[2i] + 1, ..., runs[2i + 1] of them, then zero rows (null: row r is x's row r).
  const int32_t* runs = nullptr;
  // A padded layout read through a gather of its own (an MoE layer's tokens, sorted by expert):
  // row r is x's row rows[r], a zero row where that is -1 (null: runs, or row r is x's row r).
  const int64_t* rows = nullptr;
  int G = 1;
  float* dbias_partial = nullptr;  // (row tiles, K) column sums of x per tile, or null
};

struct FinalizeParams {
  const uint32_t* amax = nullptr;
  float* scale = nullptr;
  float* scale_inv = nullptr;
  int64_t n = 0;
  int fp8 = 0;
  float epsilon = 0;
  int pow2 = 0;
};

struct DbiasParams {
  const float* partial = nullptr;
  void* out = nullptr;
  int64_t tiles = 0, K = 0;
  int dtype = 0;  // InDtype
};

// The rowwise NVFP4 or MXFP8 quantize of a small input in one launch (small_rowwise.cuh): one
// cluster of `ctas` CTAs of kSmallThreads threads, each thread holding up to kSmallBytesPerThread
// bytes of x (four 16-element chunks of a 2-byte x: 32 registers).
constexpr int kSmallThreads = 512;
constexpr int kSmallCtas = 8;  // the portable cluster size
constexpr int kSmallBytesPerThread = 128;
constexpr int kSmallRows = 128;  // row-scaled NVFP4: the rows whose amaxes a CTA's shared memory holds

struct SmallRowwiseParams {
  const void* x = nullptr;
  int64_t M = 0, K = 0;  // K a multiple of the block
  int fp8 = 0;           // MXFP8: Fp8Kind
  int row_scaled = 0;    // NVFP4: one global amax per row, else one for the tensor
  int ctas = 1;
  uint8_t* data = nullptr;    // NVFP4: (M, K / 2) E2M1 codes, two a byte; MXFP8: (M, K) FP8
  uint8_t* scales = nullptr;  // NVFP4: (M, K / 16) E4M3; MXFP8: E8M0, outer-dim-major (K / 32, M)
  float* amax = nullptr;      // NVFP4: the global amax, or M of them
};

// The bytes of x up to which a format takes the small program: where it measured faster than the
// tile programs (benchmarks/NOTES.md, quantize.py --small), within what the cluster holds (512 KiB;
// a decode step's largest activation, 16 rows of 14336 bf16, is 448 KiB). NVFP4's per-row amaxes
// and MXFP8's lighter encode (the tile program's one launch, on more SMs) leave it less room.
inline int64_t small_rowwise_bytes(int format, bool row_scaled) {
  const int64_t held = int64_t(kSmallCtas) * kSmallThreads * kSmallBytesPerThread;
  return format == kMX ? held / 4 : row_scaled ? held / 2 : held;
}

// The CTAs of the launch that quantizes an M x K input of `element_size`-byte elements in blocks
// of `block` elements, 0 where the program does not take it (past `max_bytes`), spread so that
// each thread holds as few blocks as the cluster allows.
inline int small_rowwise_ctas(int64_t M, int64_t K, int64_t element_size, int64_t block, int64_t max_bytes, bool row_scaled) {
  const int64_t blocks = M * K / block;
  if (K % block != 0 || blocks <= 0 || M * K * element_size > max_bytes || (row_scaled && M > kSmallRows)) return 0;
  return int(std::min<int64_t>(kSmallCtas, (blocks + kSmallThreads - 1) / kSmallThreads));
}

enum DequantKind { kDequantScaled = 0, kDequantMX = 1, kDequantNV = 2 };

struct DequantParams {
  int kind = 0;
  int fp8 = 0;
  const uint8_t* data = nullptr;
  const void* scales = nullptr;
  const uint32_t* amax = nullptr;  // NVFP4 (float bits), or null for q * s only
  int64_t rows = 0, cols = 0;      // stored shape in elements
  int64_t block_rows = 1, block_cols = 1;               // FP8 and MXFP8: the block,
  int64_t scale_row_stride = 0, scale_col_stride = 0;  // and the scales' strides (1x128: outer-dim-major)
  int nv_row_amax = 0;
  void* out = nullptr;
  int out_dtype = 0;  // InDtype
};

// Host entry points (register.cpp calls these; the CUDA build and the CPU test build define them).
void launch_tile(int dtype, int row_format, int col_format, const TileParams& p, void* stream);
void launch_finalize(const FinalizeParams& p, void* stream);
void launch_dbias(const DbiasParams& p, void* stream);
void launch_dequantize(const DequantParams& p, void* stream);
void launch_small_rowwise(int dtype, int format, const SmallRowwiseParams& p, void* stream);

}  // namespace gq
