// The register tile program: one or both directions of the formats training quantizes most
// (per-tensor FP8, FP8 blocks of 1x128 or 128x128, MXFP8, NVFP4 in 1x16 or 16x16 blocks, rounded
// to nearest or stochastically, and row-scaled FP8 from its pre-pass's scales) for a 2-byte input
// whose 128x128 tiles are all whole. Per-tensor and row-scaled FP8 also take row groups (a scale,
// or a row of column scales, a group) and a padded layout's runs of x's rows (MoE experts).
//
// The generic tile program (tile.cuh) serves every format, edge and option from a shared-memory
// tile that each phase reads again, which leaves it bound by the ALU pipe rather than by memory,
// its both-directions launches most of all. Here
// each thread keeps an 8x8 block of the tile in registers as loaded (16-byte loads, whole rows a
// warp), takes the row side's amaxes by warp shuffles and the column side's from the packed
// halves of its registers, and only the block scales (computed once per block, not once per
// chunk) and the transposed column bytes pass through shared memory. NVFP4's columns take the
// random Hadamard transform here in 1x16 blocks, a chunk's rows split between two lanes; its
// 16x16 blocks with the transform and random indices past 2^32 stay generic, and so does
// row-scaled NVFP4's per-row amax pass (its encode runs here). A
// rowwise_dequantized source replaces the registers by the dequantized rowwise values after the
// row side's encode, and the column side takes its statistics again from them (kernels of their
// own, kDq).
//
// Thread mapping (256 threads, 8 warps): lane l of warp w holds rows 16w + 8(l/16) .. +7 and
// columns 8(l%16) .. +7 of the tile, so the 16 lanes of a half warp cover a tile row's 256 bytes,
// a 32-element MXFP8 row block lies in 4 neighbouring lanes, a 16-element NVFP4 one in 2, and an
// NVFP4 column block's 16 rows in lanes l and l ^ 16.
//
// The 8-bit formats are not bound by issuing instructions here, so neither fewer instructions
// (conversions into formats fixed at compile time) nor a persistent form that copies its next tile
// into shared memory while the current one computes makes them faster; their stores count, so
// scales are written as contiguous runs rather than scattered words.
#pragma once

#include <type_traits>

#include "common.cuh"
#include "params.h"

namespace gq {

// Launches the register program when it takes this call (formats, dtype, shape, options), and
// says whether it did; the generic tile program takes the others.
bool launch_register_tile(int dtype, int row_format, int col_format, const TileParams& p, void* stream);

#if defined(__CUDACC__)
namespace register_tile {

constexpr int kTile = 128, kThreads = 256;
constexpr uint32_t kMagnitudes = 0x7FFF7FFFu;  // |x| of two 2-byte floats in a word
constexpr unsigned kWarp = 0xFFFFFFFFu;

template <int F>
constexpr bool kEightBit = F == kPerTensor || F == kBlock || F == kMX || F == kRowScaled;
// Formats scaled a group (or a row or column of it) at a time, from amaxes taken before: the only
// ones a grouped launch runs here.
constexpr bool group_scaled(int format) { return format == kNone || format == kPerTensor || format == kRowScaled; }
template <int F>
constexpr bool kGroupScaled = group_scaled(F);
// The blocks of a tile row (or column) whose amaxes and factors a side keeps: 16 elements long for
// NVFP4, else 32 (MXFP8's, and four per FP8 1x128 block).
template <int F>
constexpr int kBlocks = F == kNV ? 8 : 4;
// Columnwise outputs transposed to (K, M), through the stage; MXFP8 keeps x's (M, K) layout.
template <int F>
constexpr bool kStaged = F == kPerTensor || F == kBlock || F == kNV || F == kRowScaled;
// A column side that reads the dequantized rowwise values (a rowwise_dequantized source, kDq)
// has kernels of its own, one for each row format, so that the others keep their registers. With
// no column format, such a kernel is the amax pre-pass of the source (per-tensor FP8 or NVFP4
// columns): it encodes the rows without storing them and max-reduces the dequantized values
// (rounded to nearest: stochastically rounded rows take the generic program's pre-pass).
template <int R, int C, bool kDq>
constexpr bool kAmaxPass = kDq && C == kNone;

template <int R, int C, bool kDq>
struct Smem {
  uint32_t colpart[8][64];             // per warp, each column's amax over its 16 rows: two columns a word (input bits)
  uint32_t rowamax[kTile][kBlocks<R>];  // per row, each block's amax (fp32 bits)
  float rowmult[kTile][kBlocks<R>];     // the rowwise encode factor per row and block (1x128: [row][0])
  float rowdec[kDq ? kTile : 1][kBlocks<R>];  // ... and its decode factor, for a dequantized source
  float colmult[kBlocks<C>][kTile];     // the columnwise one per block and column (128x1: [0][column])
  uint32_t square[8][8];                // NVFP4 16x16 blocks' amaxes [row / 16][column / 16]
  alignas(8) uint8_t colscale[C == kNV ? kTile : 1][8];  // NVFP4 after the transform: each column's 8 block scales
  // Transposed columnwise output: row c holds column c, 128 bytes (FP8) or 64 (NVFP4). FP8's 8-byte
  // slot s lies at s ^ (c / 8 % 16), NVFP4's 4-byte one likewise, so that the lanes of a half warp,
  // storing one column each, hit different banks.
  alignas(16) uint8_t stage[kStaged<C> ? kTile : 1][C == kNV ? kTile / 2 : kTile];
};

__device__ __forceinline__ uint32_t fold(uint32_t halves) { return umax(halves & 0xFFFFu, halves >> 16); }

template <class In>
__device__ __forceinline__ uint32_t amax_bits(uint32_t magnitude) {
  return abs_bits(In::to_float(typename In::S(magnitude)));
}

template <class In>
__device__ __forceinline__ void unpack8(uint4 d, float v[8]) {
  const uint32_t u[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = In::to_float(typename In::S(u[i] & 0xFFFFu));
    v[2 * i + 1] = In::to_float(typename In::S(u[i] >> 16));
  }
}

// cast_to_fp8(v[i] * f[i]) of eight values as eight bytes: with kPlain (no product can be NaN, as
// in fp8_encode16) the conversion alone, else fp8_encode2's clamp and NaN encoding.
template <bool kPlain>
__device__ __forceinline__ uint2 encode8(const float v[8], const float f[8], int kind) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 y = make_float2(v[2 * i] * f[2 * i], v[2 * i + 1] * f[2 * i + 1]);
    if constexpr (!kPlain) w[i] = fp8_encode2(y.x, y.y, kind);
    else w[i] = kind == kE4M3 ? __nv_cvt_float2_to_fp8x2(y, __NV_SATFINITE, __NV_E4M3) : __nv_cvt_float2_to_fp8x2(y, __NV_SATFINITE, __NV_E5M2);
  }
  return make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
}

__device__ __forceinline__ bool usable(float factor) { return factor > 0.0f && factor <= kFltMax; }

// What a block's scale multiplies by to encode, and to decode (NVFP4: the block's part of it).
struct Factor {
  float encode, decode;
};

// The block scale of an FP8 block with this amax; its decode factor is what is stored.
__device__ __forceinline__ Factor block_factor(const Encoder& e, uint32_t amax, float* stored) {
  const float scale = scale_from_amax(u2f(amax), e.fp8, e.epsilon, e.pow2);
  const float decode = 1.0f / scale;
  *stored = decode;
  return {scale, decode};
}

__device__ __forceinline__ Factor mx_factor(const Encoder& e, uint32_t amax, uint8_t* stored) {
  const uint8_t biased = e8m0_from_amax(u2f(amax), e.fp8);
  *stored = biased;
  return {mx_encode_multiplier(biased), mx_decode_scale(biased)};
}

// Four NVFP4 blocks' E4M3 scales as one word (the first in the low byte) and their factors.
__device__ __forceinline__ uint32_t nv_factors(const NvGlobal& g, const uint32_t amax[4], Factor factor[4]) {
  uint32_t bytes = 0;
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    const uint8_t scale = nv_block_scale(u2f(amax[b]), g.mult);
    factor[b] = {nv_encode_factor(scale, g.s_dec), e4m3_value(scale)};
    bytes |= uint32_t(scale) << (8 * b);
  }
  return bytes;
}

// One row's eight rowwise values dequantized as Representation.dequantize does, fp32 products
// rounded to x's dtype and packed as x's words: 8-bit, byte * dec of the stored bytes; NVFP4,
// (grid value * dec) * g_dec of the grid values its codes stand for.
template <class In, int R>
__device__ __forceinline__ uint4 dequantized(uint2 stored, const float grid[8], float dec, float g_dec, int kind) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t half[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int e = 2 * i + h;
      float value;
      if constexpr (R == kNV) value = (grid[e] * dec) * g_dec;
      else value = fp8_decode(uint8_t((e < 4 ? stored.x : stored.y) >> (8 * (e & 3))), kind) * dec;
      half[h] = In::from_float(value);
    }
    w[i] = half[0] | (half[1] << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The E2M1 code of y: to nearest even, or stochastically with the bits of `index` in `stream`;
// where `grid` is given, the grid value the code stands for too (rounded to nearest, from the
// rounding itself).
template <bool kStochastic>
__device__ __forceinline__ uint32_t e2m1_code(float y, uint32_t stream, uint32_t index, float* grid = nullptr) {
  if constexpr (kStochastic) {
    const uint8_t code = e2m1_stochastic(y, random_bits_at(stream, index));
    if (grid) *grid = e2m1_value(code);
    return code;
  } else {
    const E2m1Rounded rounded = e2m1_round_nearest(y);
    if (grid) *grid = rounded.value;
    return rounded.code;
  }
}

// Column i's value in one row of the thread's block: half i % 2 of word i / 2.
template <class In>
__device__ __forceinline__ float column_value(const uint4& row, int i) {
  const int j = i >> 1;
  const uint32_t word = j < 2 ? (j == 0 ? row.x : row.y) : (j == 2 ? row.z : row.w);
  return In::to_float(typename In::S((i & 1) ? word >> 16 : word & 0xFFFFu));
}

// nvfp4.hadamard_transform of a 16-row column chunk whose rows 8h .. 8h + 7 this lane holds and
// lane ^ 16 the others: hadamard16's steps in its order, the last one (rows j and j + 8) across
// the two lanes.
template <class In>
__device__ __forceinline__ void hadamard_halves(float y[8], int h, bool sign_mask) {
  hadamard_steps<8>(y, 8 * h, sign_mask);
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float other = __shfl_xor_sync(kWarp, y[k], 16);
    y[k] = rounded_to<In>((h == 0 ? y[k] + other : other - y[k]) * 0.25f);
  }
}

// f(std::true_type) or f(std::false_type) as `on` says; a flag that cannot be on (kAsk false)
// takes the false form only, so code that a launch never runs is not generated.
template <bool kAsk, class F>
__device__ __forceinline__ void with_flag(bool on, F&& f) {
  if constexpr (kAsk) {
    if (on) {
      f(std::true_type{});
      return;
    }
  }
  f(std::false_type{});
}

// Tile `cta` of the launch, in bands of kBand tile rows taken column by column: the few scale
// bytes a row or column gets from one tile (MXFP8's and NVFP4's rowwise scales lie along tile
// columns, NVFP4's columnwise ones along tile rows) then share 32-byte sectors written by CTAs
// that run together.
constexpr uint32_t kBand = 8;
struct TilePlace {
  uint32_t bx, by;
};
__device__ __forceinline__ TilePlace place(uint32_t cta, uint32_t tiles_x, uint32_t tiles_y) {
  const uint32_t band = cta / (kBand * tiles_x), in_band = cta - band * kBand * tiles_x;
  const uint32_t rows = min(kBand, tiles_y - band * kBand);
  const uint32_t bx = in_band / rows;
  return {bx, band * kBand + (in_band - bx * rows)};
}

template <class In, int R, int C, bool kDq>
__global__ void __launch_bounds__(kThreads, 3) register_tile_kernel(const TileParams p) {
  __shared__ Smem<R, C, kDq> s;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const uint32_t tiles_x = uint32_t(p.K / kTile), tiles_y = uint32_t(p.M / kTile);
  const TilePlace at = place(blockIdx.x, tiles_x, tiles_y);
  const uint32_t by = at.by;
  const int64_t row0 = int64_t(by) * kTile, col0 = int64_t(at.bx) * kTile;
  const int r0 = 16 * warp + 8 * (lane >> 4), c0 = 8 * (lane & 15);
  const bool row_2d = R == kBlock && p.row.two_d, col_2d = C == kBlock && p.col.two_d;  // 128x128 blocks
  const bool row_16 = R == kNV && p.row.two_d, col_16 = C == kNV && p.col.two_d;        // 16x16 blocks
  const Encoder &er = p.row, &ec = p.col;

  // A grouped launch's tile lies in one group; in a padded layout it holds a run of x's rows, then
  // zero rows, or rows read through a gather (p.rows).
  const int g = p.group_start != nullptr ? group_of(p, row0) : 0;
  const int64_t first_row = p.runs != nullptr ? p.runs[2 * by] : row0;
  const int rows_in = p.runs != nullptr ? p.runs[2 * by + 1] : kTile;

  uint4 d[8];
  const uint16_t* x = static_cast<const uint16_t*>(p.x) + (first_row + r0) * p.K + col0 + c0;
  if (!(kGroupScaled<R> && kGroupScaled<C>) || p.rows == nullptr) {
#pragma unroll
    for (int k = 0; k < 8; ++k) d[k] = r0 + k < rows_in ? __ldcs(reinterpret_cast<const uint4*>(x + k * p.K)) : make_uint4(0, 0, 0, 0);
  } else {  // through a gather (grouped launches alone): each row where its index says, a zero row at -1
    int64_t source[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) source[k] = p.rows[row0 + r0 + k];
    const uint16_t* base = static_cast<const uint16_t*>(p.x) + col0 + c0;
#pragma unroll
    for (int k = 0; k < 8; ++k) d[k] = source[k] >= 0 ? __ldcs(reinterpret_cast<const uint4*>(base + source[k] * p.K)) : make_uint4(0, 0, 0, 0);
  }

  // Column amaxes of d over the thread's 8 rows, then the warp's 16 (and the 16x16 blocks'); says
  // whether the thread's values are all finite.
  auto column_stats = [&] {
    uint32_t cm[4] = {0, 0, 0, 0};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t u[4] = {d[k].x, d[k].y, d[k].z, d[k].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) cm[j] = umax_halves(cm[j], u[j] & kMagnitudes);
    }
    const bool finite = amax_bits<In>(fold(umax_halves(umax_halves(cm[0], cm[1]), umax_halves(cm[2], cm[3])))) <= 0x7F800000u;
#pragma unroll
    for (int j = 0; j < 4; ++j) cm[j] = umax_halves(cm[j], __shfl_xor_sync(kWarp, cm[j], 16));
    if (lane < 16) *reinterpret_cast<uint4*>(&s.colpart[warp][4 * lane]) = make_uint4(cm[0], cm[1], cm[2], cm[3]);
    if (row_16 || col_16) {  // a 16x16 block: the warp's 16 rows of two lanes' columns
      uint32_t m = umax_halves(umax_halves(cm[0], cm[1]), umax_halves(cm[2], cm[3]));
      m = umax_halves(m, __shfl_xor_sync(kWarp, m, 1));
      if (lane < 16 && (lane & 1) == 0) s.square[warp][lane >> 1] = amax_bits<In>(fold(m));
    }
    return finite;
  };
  bool finite = column_stats();

  // Row amaxes of the row side's blocks: four lanes hold a 32-column one, two a 16-column one.
  if constexpr (R == kMX || R == kBlock || R == kNV) {
    constexpr int kLanes = kTile / kBlocks<R> / 8;
    if (!row_2d && !row_16) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        uint32_t m = umax_halves(umax_halves(d[k].x & kMagnitudes, d[k].y & kMagnitudes),
                                 umax_halves(d[k].z & kMagnitudes, d[k].w & kMagnitudes));
#pragma unroll
        for (int offset = 1; offset < kLanes; offset <<= 1) m = umax_halves(m, __shfl_xor_sync(kWarp, m, offset));
        if ((lane & (kLanes - 1)) == 0) s.rowamax[r0 + k][(lane & 15) / kLanes] = amax_bits<In>(fold(m));
      }
    }
  }
  __syncthreads();

  // The block scales, once per block: written out, and their factors kept for the encode (and,
  // rowwise, for a dequantized source).
  auto keep_row = [&](int r, int b, Factor f) {
    s.rowmult[r][b] = f.encode;
    if constexpr (kDq) s.rowdec[r][b] = f.decode;
  };
  // The whole tile's amax (from colpart) where a side wants it: 128x128 blocks, delayed scaling.
  auto tile_amax = [&](bool row_side, bool col_side) {
    const bool rows = row_side && (row_2d || p.acc.row_global), cols = col_side && (col_2d || p.acc.col_global);
    if (!(rows || cols) || warp != 7) return;
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) m = umax_halves(m, s.colpart[i >> 1][32 * (i & 1) + lane]);
    for (int offset = 16; offset > 0; offset >>= 1) m = umax_halves(m, __shfl_xor_sync(kWarp, m, offset));
    const uint32_t amax = amax_bits<In>(fold(m));
    if (lane != 0) return;
    if (rows && p.acc.row_global) atomic_umax(p.acc.row_global + g, amax);
    if (cols && p.acc.col_global) atomic_umax(p.acc.col_global + g, amax);
    if (rows && row_2d) keep_row(0, 0, block_factor(er, amax, static_cast<float*>(er.scales) + int64_t(by) * tiles_x + col0 / kTile));
    if (cols && col_2d) s.colmult[0][0] = block_factor(ec, amax, static_cast<float*>(ec.scales) + (col0 / kTile) * (p.M / kTile) + by).encode;
  };
  auto row_scales = [&] {
    if constexpr (R == kMX) {
#pragma unroll
      for (int q = tid; q < kTile * 4; q += kThreads) {  // outer-dim-major: a warp writes 32 consecutive bytes
        const int r = q % kTile, b = q / kTile;
        keep_row(r, b, mx_factor(er, s.rowamax[r][b], static_cast<uint8_t*>(er.scales) + int64_t(col0 / 32 + b) * p.M + row0 + r));
      }
    } else if constexpr (R == kBlock) {
      if (!row_2d && tid < kTile) {
        const uint32_t m = umax(umax(s.rowamax[tid][0], s.rowamax[tid][1]), umax(s.rowamax[tid][2], s.rowamax[tid][3]));
        keep_row(tid, 0, block_factor(er, m, static_cast<float*>(er.scales) + (col0 / kTile) * p.M + row0 + tid));  // outer-dim-major
      }
    } else if constexpr (R == kNV) {  // a thread a row and half its blocks: four scales in one store
      const int r = tid >> 1, b0 = 4 * (tid & 1);
      uint32_t amax[4];
      Factor f[4];
#pragma unroll
      for (int b = 0; b < 4; ++b) amax[b] = row_16 ? s.square[r >> 4][b0 + b] : s.rowamax[r][b0 + b];
      uint8_t* out = static_cast<uint8_t*>(er.scales) + (row0 + r) * (p.K / 16) + col0 / 16 + b0;
      *reinterpret_cast<uint32_t*>(out) = nv_factors(nv_global(u2f(er.amax[er.row_scaled ? row0 + r : 0])), amax, f);
#pragma unroll
      for (int b = 0; b < 4; ++b) keep_row(r, b0 + b, f[b]);
    }
  };
  auto column_scales = [&] {
    if constexpr (C == kMX) {
#pragma unroll
      for (int q = tid; q < kTile * 4; q += kThreads) {
        const int b = q >> 7, c = q & (kTile - 1), shift = 16 * (c & 1);
        const uint32_t m = umax_halves(s.colpart[2 * b][c >> 1], s.colpart[2 * b + 1][c >> 1]);
        uint8_t* out = static_cast<uint8_t*>(ec.scales) + (row0 / 32 + b) * p.K + col0 + c;
        s.colmult[b][c] = mx_factor(ec, amax_bits<In>((m >> shift) & 0xFFFFu), out).encode;
      }
    } else if constexpr (C == kBlock) {
      if (!col_2d && tid >= kThreads - kTile) {
        const int c = tid - (kThreads - kTile), shift = 16 * (c & 1);
        uint32_t m = 0;
#pragma unroll
        for (int w = 0; w < 8; ++w) m = umax_halves(m, s.colpart[w][c >> 1]);
        float* out = static_cast<float*>(ec.scales) + int64_t(by) * p.K + col0 + c;  // outer-dim-major
        s.colmult[0][c] = block_factor(ec, amax_bits<In>((m >> shift) & 0xFFFFu), out).encode;
      }
    } else if constexpr (C == kNV) {
      if (!p.col_rht) {  // a thread a column and half its blocks (after a transform, the encode finds them)
        const int c = tid >> 1, w0 = 4 * (tid & 1), shift = 16 * (c & 1);
        uint32_t amax[4];
        Factor f[4];
#pragma unroll
        for (int b = 0; b < 4; ++b) amax[b] = col_16 ? s.square[w0 + b][c >> 4] : amax_bits<In>((s.colpart[w0 + b][c >> 1] >> shift) & 0xFFFFu);
        uint8_t* out = static_cast<uint8_t*>(ec.scales) + (col0 + c) * (p.M / 16) + row0 / 16 + w0;
        *reinterpret_cast<uint32_t*>(out) = nv_factors(nv_global(u2f(ec.amax[0])), amax, f);
#pragma unroll
        for (int b = 0; b < 4; ++b) s.colmult[w0 + b][c] = f[b].encode;
      }
    }
  };
  tile_amax(true, !kDq);
  row_scales();
  if constexpr (!kDq) column_scales();
  __syncthreads();

  // Row k of the thread's block, rowwise, to its place in (M, K): the conversion alone where
  // kPlain (no product can be NaN: none in x, and every factor a positive finite number), else
  // the careful encode; NVFP4's rounding to nearest or stochastic. Gives the bytes (NVFP4: the
  // eight codes in .x, and their grid values in `grid`) for a dequantized source.
  float fr[8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
    fr[i] = R == kNV ? s.rowmult[r0 + i][c0 >> 4] : R == kMX ? s.rowmult[r0 + i][c0 >> 5] : R == kBlock ? s.rowmult[row_2d ? 0 : r0 + i][0]
          : R == kPerTensor ? er.scale[g] : R == kRowScaled ? er.scale[row0 + r0 + i] : 1.0f;
  // Stochastic rounding's bits: element (r, c) of x draws index r * K + c rowwise and c * M + r
  // columnwise (x^T's), all below 2^32 here, so one stream (index_hi = 0) serves the launch.
  const uint32_t row_stream = R == kNV && er.sr ? random_stream(sr_key_of(er), 0) : 0;
  const uint32_t row_index = uint32_t((row0 + r0) * p.K + col0 + c0);
  auto encode_row = [&](int k, const float v[8], auto plain_type, auto row_sr_type, float grid[8]) {
    [[maybe_unused]] constexpr bool kPlain = decltype(plain_type)::value, kRowSR = decltype(row_sr_type)::value;
    uint2 out = make_uint2(0, 0);
    if constexpr (kEightBit<R>) {
      float f[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = fr[k];
      out = encode8<kPlain>(v, f, er.fp8);
      if constexpr (!kAmaxPass<R, C, kDq>) *reinterpret_cast<uint2*>(er.data + (row0 + r0 + k) * p.K + col0 + c0) = out;
    } else if constexpr (R == kNV) {  // nvfp4.pack: element 2i in the low nibble of byte i
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        out.x |= e2m1_code<kRowSR>(v[i] * fr[k], row_stream, row_index + uint32_t(k * p.K) + i, kDq ? &grid[i] : nullptr) << (4 * i);
      }
      if constexpr (!kAmaxPass<R, C, kDq>) *reinterpret_cast<uint32_t*>(er.data + (row0 + r0 + k) * (p.K / 2) + (col0 + c0) / 2) = out.x;
    }
    return out;
  };
  bool row_plain = finite;
#pragma unroll
  for (int i = 0; i < 8; ++i) row_plain = row_plain && (!kEightBit<R> || usable(fr[i]));

  // A dequantized source: the rowwise values, decoded and rounded to x's dtype as
  // Representation.dequantize gives them, replace x in the registers; the column side's
  // statistics and scales are then taken again, from them.
  if constexpr (kDq) {
    // NVFP4's global decode factor: the tensor's, or each row's where rows are scaled alone.
    const float tensor_g_dec = R == kNV ? nv_global(u2f(er.amax[0])).g_dec : 1.0f;
    with_flag<kEightBit<R>>(row_plain, [&](auto kPlain) {
      with_flag<R == kNV && !kAmaxPass<R, C, kDq>>(er.sr, [&](auto kRowSR) {  // the amax pass: no stochastic rows (they would spill)
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const float dec = R == kNV ? s.rowdec[r0 + k][c0 >> 4] : R == kMX ? s.rowdec[r0 + k][c0 >> 5]
                          : R == kBlock ? s.rowdec[row_2d ? 0 : r0 + k][0] : er.scale_inv[g];
          const float g_dec = R == kNV && er.row_scaled ? nv_global(u2f(er.amax[row0 + r0 + k])).g_dec : tensor_g_dec;
          float v[8], grid[8];
          unpack8<In>(d[k], v);
          d[k] = dequantized<In, R>(encode_row(k, v, kPlain, kRowSR, grid), grid, dec, g_dec, er.fp8);
        }
      });
    });
    finite = column_stats();
    __syncthreads();
    tile_amax(false, true);
    if constexpr (kAmaxPass<R, C, kDq>) return;
    column_scales();
    __syncthreads();
  }

  // Each row once: its rowwise bytes (unless a dequantized source took them), its columnwise ones
  // with each column's own factor, under the same rule for kPlain.
  float fc[8];
  bool plain = finite;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    fc[i] = C == kNV ? s.colmult[warp][c0 + i] : C == kMX ? s.colmult[r0 >> 5][c0 + i] : C == kBlock ? s.colmult[0][col_2d ? 0 : c0 + i]
          : C == kPerTensor ? ec.scale[g] : C == kRowScaled ? ec.scale[g * p.K + col0 + c0 + i] : 1.0f;
    if constexpr (kEightBit<C>) plain = plain && usable(fc[i]);
  }
  if constexpr (!kDq) plain = plain && row_plain;
  const uint32_t col_stream = C == kNV && ec.sr ? random_stream(sr_key_of(ec), 0) : 0;
  const uint32_t col_index = uint32_t((col0 + c0) * p.M + row0 + r0);
  uint2 q[8];       // 8-bit columnwise: each of the thread's rows, 8 bytes
  uint32_t nq[8] = {};  // NVFP4 columnwise: each of the thread's columns, 8 codes
  auto encode = [&](auto plain_type, auto row_sr_type, auto col_sr_type, auto col_rht_type) {
    [[maybe_unused]] constexpr bool kPlain = decltype(plain_type)::value, kColSR = decltype(col_sr_type)::value;
    constexpr bool kColRHT = decltype(col_rht_type)::value;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float v[8];
      unpack8<In>(d[k], v);
      if constexpr (!kDq) encode_row(k, v, plain_type, row_sr_type, nullptr);
      if constexpr (kEightBit<C>) q[k] = encode8<kPlain>(v, fc, ec.fp8);
      if constexpr (C == kNV && !kColRHT) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const uint32_t code = e2m1_code<kColSR>(v[i] * fc[i], col_stream, col_index + uint32_t(i * p.M) + k);
          nq[i] |= code << (4 * k);
        }
      }
    }
    if constexpr (kColRHT) {  // column by column: each 1x16 block is one transformed chunk in lanes l and l ^ 16
      const int h = lane >> 4;
      const NvGlobal g = nv_global(u2f(ec.amax[0]));
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        float y[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) y[k] = column_value<In>(d[k], i);
        hadamard_halves<In>(y, h, p.col_sign_mask);
        uint32_t m = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) m = umax(m, abs_bits(y[k]));
        m = umax(m, __shfl_xor_sync(kWarp, m, 16));
        const uint8_t scale = nv_block_scale(u2f(m), g.mult);
        const float factor = nv_encode_factor(scale, g.s_dec);
        if (h == 0) s.colscale[c0 + i][warp] = scale;
#pragma unroll
        for (int k = 0; k < 8; ++k) nq[i] |= e2m1_code<kColSR>(y[k] * factor, col_stream, col_index + uint32_t(i * p.M) + k) << (4 * k);
      }
    }
  };
  with_flag<kEightBit<R> || kEightBit<C>>(plain, [&](auto kPlain) {
    with_flag<R == kNV && !kDq>(er.sr, [&](auto kRowSR) {
      with_flag<C == kNV>(ec.sr, [&](auto kColSR) {
        with_flag<C == kNV>(p.col_rht, [&](auto kColRHT) { encode(kPlain, kRowSR, kColSR, kColRHT); });
      });
    });
  });
  if constexpr (C == kNV) {  // (K, M / 2): the thread's 4 bytes of each of its columns into the stage, then whole rows out
    uint32_t* stage = reinterpret_cast<uint32_t*>(&s.stage[0][0]);
    const int slot = (2 * warp + (lane >> 4)) ^ (lane & 15);  // word 2w + l / 16 of a row, at word ^ (c / 8 % 16)
#pragma unroll
    for (int i = 0; i < 8; ++i) stage[(c0 + i) * 16 + slot] = nq[i];
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // 16 bytes of row c: its logical words 4g .. 4g + 3, found permuted in word group g ^ key / 4
      const int piece = tid + kThreads * i, c = piece >> 2, g = piece & 3, key = (c >> 3) & 15;
      uint4 w = *reinterpret_cast<const uint4*>(&stage[c * 16 + 4 * (g ^ (key >> 2))]);
      if (key & 1) w = make_uint4(w.y, w.x, w.w, w.z);
      if (key & 2) w = make_uint4(w.z, w.w, w.x, w.y);
      *reinterpret_cast<uint4*>(ec.data + (col0 + c) * (p.M / 2) + row0 / 2 + 16 * g) = w;
    }
    if (p.col_rht && tid < kTile) {  // the scales the encode found, a column's 8 in one store
      uint8_t* out = static_cast<uint8_t*>(ec.scales) + (col0 + tid) * (p.M / 16) + row0 / 16;
      *reinterpret_cast<uint2*>(out) = *reinterpret_cast<const uint2*>(&s.colscale[tid][0]);
    }
  } else if constexpr (C == kMX) {  // MXFP8 keeps x's (M, K) layout
#pragma unroll
    for (int k = 0; k < 8; ++k) *reinterpret_cast<uint2*>(ec.data + (row0 + r0 + k) * p.K + col0 + c0) = q[k];
  } else if constexpr (C != kNone) {  // (K, M): this thread's 8x8 bytes transposed into the stage, then whole rows out
    const int slot = (r0 >> 3) ^ (lane & 15);
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const uint32_t sel = c & 3;
      const uint32_t w[8] = {c < 4 ? q[0].x : q[0].y, c < 4 ? q[1].x : q[1].y, c < 4 ? q[2].x : q[2].y, c < 4 ? q[3].x : q[3].y,
                             c < 4 ? q[4].x : q[4].y, c < 4 ? q[5].x : q[5].y, c < 4 ? q[6].x : q[6].y, c < 4 ? q[7].x : q[7].y};
      const uint32_t pick = sel | ((sel + 4) << 4);  // byte sel of the first word, then of the second
      const uint32_t lo = __byte_perm(__byte_perm(w[0], w[1], pick), __byte_perm(w[2], w[3], pick), 0x5410);
      const uint32_t hi = __byte_perm(__byte_perm(w[4], w[5], pick), __byte_perm(w[6], w[7], pick), 0x5410);
      *reinterpret_cast<uint2*>(&s.stage[c0 + c][8 * slot]) = make_uint2(lo, hi);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int piece = tid + kThreads * i, c = piece >> 3, b = piece & 7, key = (c >> 3) & 15;
      const uint2 a = *reinterpret_cast<const uint2*>(&s.stage[c][8 * ((2 * b) ^ key)]);
      const uint2 z = *reinterpret_cast<const uint2*>(&s.stage[c][8 * ((2 * b + 1) ^ key)]);
      *reinterpret_cast<uint4*>(ec.data + (col0 + c) * p.M + row0 + 16 * b) = make_uint4(a.x, a.y, z.x, z.y);
    }
  }
}

template <class In, int R, int C, bool kDq>
void launch(const TileParams& p, void* stream) {
  const int64_t tiles = (p.M / kTile) * (p.K / kTile);
  register_tile_kernel<In, R, C, kDq><<<unsigned(tiles), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
}

using Launcher = void (*)(const TileParams&, void*);

// The formats the program encodes (a direction may be none), in the order of the tables below;
// -1: not one of them.
constexpr int slot_of(int format) {
  return format == kPerTensor ? 0 : format == kBlock ? 1 : format == kMX ? 2 : format == kNV ? 3 : format == kNone ? 4 : format == kRowScaled ? 5 : -1;
}

template <class In, int R, int C, bool kDq>
constexpr Launcher launcher_of() {
  if constexpr (R == kNone && (C == kNone || kDq)) return nullptr;  // nothing to encode, or nothing to dequantize
  // Row-scaled FP8 beside formats scaled as it is, from x itself.
  else if constexpr ((R == kRowScaled || C == kRowScaled) && (kDq || !kGroupScaled<R> || !kGroupScaled<C>)) return nullptr;
  else return &launch<In, R, C, kDq>;
}

template <class In, int R, bool kDq>
constexpr Launcher kLaunchers[6] = {launcher_of<In, R, kPerTensor, kDq>(), launcher_of<In, R, kBlock, kDq>(),
                                    launcher_of<In, R, kMX, kDq>(),        launcher_of<In, R, kNV, kDq>(),
                                    launcher_of<In, R, kNone, kDq>(),      launcher_of<In, R, kRowScaled, kDq>()};

// The kernel of a (row slot, column slot) pair, null where none is: instantiated per input dtype
// and source in register_tile_<dtype>[_dequantized].cu, so that the four compile in parallel.
template <class In, bool kDq>
Launcher launcher(int row_slot, int col_slot) {
  switch (row_slot) {
    case 0: return kLaunchers<In, kPerTensor, kDq>[col_slot];
    case 1: return kLaunchers<In, kBlock, kDq>[col_slot];
    case 2: return kLaunchers<In, kMX, kDq>[col_slot];
    case 3: return kLaunchers<In, kNV, kDq>[col_slot];
    case 5: return kLaunchers<In, kRowScaled, kDq>[col_slot];
    default: return kLaunchers<In, kNone, kDq>[col_slot];
  }
}

}  // namespace register_tile
#endif

}  // namespace gq
