// The register tile program: one or both directions of 8-bit formats (per-tensor FP8, FP8 blocks
// of 1x128 or 128x128, MXFP8) for a 2-byte input whose 128x128 tiles are all whole.
//
// The generic tile program (tile.cuh) serves every format, edge and option from a shared-memory
// tile that each phase reads again; ncu found it bound by the ALU pipe, not by memory, and its
// both-directions launches at 62-68% of copy bandwidth against 78-86% for one direction. Here
// each thread keeps an 8x8 block of the tile in registers as loaded (16-byte loads, whole rows a
// warp), takes the row side's amaxes by warp shuffles and the column side's from the packed
// halves of its registers, and only the block scales (computed once per block, not once per
// chunk) and the transposed column bytes pass through shared memory.
//
// Thread mapping (256 threads, 8 warps): lane l of warp w holds rows 16w + 8(l/16) .. +7 and
// columns 8(l%16) .. +7 of the tile, so the 16 lanes of a half warp cover a tile row's 256 bytes
// and a 32-element MXFP8 row block lies in 4 neighbouring lanes.
//
// On the H200 (benchmarks/NOTES.md rows 55-57): both directions at 73-87% of copy bandwidth (the
// generic program 62-66%), one direction at 80-92%. Neither a persistent form that copies its next
// tile into shared memory while the current one computes (slower, the both-directions launches
// most) nor conversions into formats fixed at compile time (a fifth fewer instructions on the hot
// path, no faster) helped: the program is no longer bound by issuing instructions.
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

template <int C>
struct Smem {
  uint32_t colpart[8][64];     // per warp, each column's amax over its 16 rows: two columns a word (input bits)
  uint32_t rowamax[kTile][4];  // per row, each 32-column block's amax (fp32 bits)
  float rowmult[kTile][4];     // the rowwise encode factor per row and 32-column block (1x128: [row][0])
  float colmult[4][kTile];     // the columnwise one per 32-row block and column (128x1: [0][column])
  // Transposed columnwise bytes: row c holds column c; its 8-byte slot s lies at s ^ (c / 8 % 16),
  // so the 16 lanes storing one column each of a half warp hit 16 different slots (banks).
  alignas(16) uint8_t stage[C == kPerTensor || C == kBlock ? kTile : 1][kTile];
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

// The block scale of an FP8 block with this amax: its encode factor, its decode factor stored.
__device__ __forceinline__ float block_factor(const Encoder& e, uint32_t amax, float* stored) {
  const float scale = scale_from_amax(u2f(amax), e.fp8, e.epsilon, e.pow2);
  *stored = 1.0f / scale;
  return scale;
}

__device__ __forceinline__ float mx_factor(const Encoder& e, uint32_t amax, uint8_t* stored) {
  const uint8_t biased = e8m0_from_amax(u2f(amax), e.fp8);
  *stored = biased;
  return mx_encode_multiplier(biased);
}

// Tile `cta` of the launch, in bands of kBand tile rows taken column by column: the 4-byte block
// scales of neighbouring tiles (a column's 128x1 scales lie along tile rows, a row's 1x128 ones
// along tile columns) then share 32-byte sectors written by CTAs that run together.
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

template <class In, int R, int C>
__global__ void __launch_bounds__(kThreads, 3) register_tile_kernel(const TileParams p) {
  __shared__ Smem<C> s;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const uint32_t tiles_x = uint32_t(p.K / kTile), tiles_y = uint32_t(p.M / kTile);
  const TilePlace at = place(blockIdx.x, tiles_x, tiles_y);
  const uint32_t by = at.by;
  const int64_t row0 = int64_t(by) * kTile, col0 = int64_t(at.bx) * kTile;
  const int r0 = 16 * warp + 8 * (lane >> 4), c0 = 8 * (lane & 15);
  const bool row_2d = R == kBlock && p.row.two_d, col_2d = C == kBlock && p.col.two_d;
  const bool tile_wanted = row_2d || col_2d || p.acc.row_global || p.acc.col_global;

  uint4 d[8];
  const uint16_t* x = static_cast<const uint16_t*>(p.x) + (row0 + r0) * p.K + col0 + c0;
#pragma unroll
  for (int k = 0; k < 8; ++k) d[k] = __ldcs(reinterpret_cast<const uint4*>(x + k * p.K));

  // Column amaxes over the thread's 8 rows, then the warp's 16; they also bound the thread's values.
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

  // Row amaxes of the 32-column blocks: four lanes hold one.
  if constexpr (R == kMX || R == kBlock) {
    if (!row_2d) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        uint32_t m = umax_halves(umax_halves(d[k].x & kMagnitudes, d[k].y & kMagnitudes),
                                 umax_halves(d[k].z & kMagnitudes, d[k].w & kMagnitudes));
        m = umax_halves(m, __shfl_xor_sync(kWarp, m, 1));
        m = umax_halves(m, __shfl_xor_sync(kWarp, m, 2));
        if ((lane & 3) == 0) s.rowamax[r0 + k][(lane & 15) >> 2] = amax_bits<In>(fold(m));
      }
    }
  }
  __syncthreads();

  // The block scales, once per block: written out, and their encode factors kept for the encode.
  const Encoder &er = p.row, &ec = p.col;
  if (tile_wanted && warp == 7) {
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) m = umax_halves(m, s.colpart[i >> 1][32 * (i & 1) + lane]);
    for (int offset = 16; offset > 0; offset >>= 1) m = umax_halves(m, __shfl_xor_sync(kWarp, m, offset));
    const uint32_t amax = amax_bits<In>(fold(m));
    if (lane == 0) {
      if (p.acc.row_global) atomic_umax(p.acc.row_global, amax);
      if (p.acc.col_global) atomic_umax(p.acc.col_global, amax);
      if (row_2d) {
        float* out = static_cast<float*>(er.scales);
        s.rowmult[0][0] = block_factor(er, amax, &out[int64_t(by) * tiles_x + col0 / kTile]);
      }
      if (col_2d) {
        float* out = static_cast<float*>(ec.scales);
        s.colmult[0][0] = block_factor(ec, amax, &out[(col0 / kTile) * (p.M / kTile) + by]);
      }
    }
  }
  if constexpr (R == kMX) {
#pragma unroll
    for (int q = tid; q < kTile * 4; q += kThreads) {
      const int r = q >> 2, b = q & 3;
      uint8_t* out = static_cast<uint8_t*>(er.scales) + (row0 + r) * (p.K / 32) + col0 / 32 + b;
      s.rowmult[r][b] = mx_factor(er, s.rowamax[r][b], out);
    }
  } else if constexpr (R == kBlock) {
    if (!row_2d && tid < kTile) {
      const uint32_t m = umax(umax(s.rowamax[tid][0], s.rowamax[tid][1]), umax(s.rowamax[tid][2], s.rowamax[tid][3]));
      float* out = static_cast<float*>(er.scales) + (row0 + tid) * tiles_x + col0 / kTile;
      s.rowmult[tid][0] = block_factor(er, m, out);
    }
  }
  if constexpr (C == kMX) {
#pragma unroll
    for (int q = tid; q < kTile * 4; q += kThreads) {
      const int b = q >> 7, c = q & (kTile - 1), shift = 16 * (c & 1);
      const uint32_t m = umax_halves(s.colpart[2 * b][c >> 1], s.colpart[2 * b + 1][c >> 1]);
      uint8_t* out = static_cast<uint8_t*>(ec.scales) + (row0 / 32 + b) * p.K + col0 + c;
      s.colmult[b][c] = mx_factor(ec, amax_bits<In>((m >> shift) & 0xFFFFu), out);
    }
  } else if constexpr (C == kBlock) {
    if (!col_2d && tid >= kThreads - kTile) {
      const int c = tid - (kThreads - kTile), shift = 16 * (c & 1);
      uint32_t m = 0;
#pragma unroll
      for (int w = 0; w < 8; ++w) m = umax_halves(m, s.colpart[w][c >> 1]);
      float* out = static_cast<float*>(ec.scales) + (col0 + c) * (p.M / kTile) + by;
      s.colmult[0][c] = block_factor(ec, amax_bits<In>((m >> shift) & 0xFFFFu), out);
    }
  }
  __syncthreads();

  // Each row once: its rowwise bytes to their place in (M, K), its columnwise bytes with each
  // column's own factor. One branch for the thread: the conversion alone where no product can be
  // NaN (NaN in x, or a factor that is not a positive finite number), else the careful encode.
  float fr[8], fc[8];
  bool plain = finite;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    fr[i] = R == kMX ? s.rowmult[r0 + i][c0 >> 5] : R == kBlock ? s.rowmult[row_2d ? 0 : r0 + i][0] : R == kPerTensor ? er.scale[0] : 1.0f;
    fc[i] = C == kMX ? s.colmult[r0 >> 5][c0 + i] : C == kBlock ? s.colmult[0][col_2d ? 0 : c0 + i] : C == kPerTensor ? ec.scale[0] : 1.0f;
    plain = plain && usable(fr[i]) && usable(fc[i]);
  }
  uint2 q[8];
  auto encode = [&](auto plain_type) {
    constexpr bool kPlain = decltype(plain_type)::value;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float v[8], f[8];
      unpack8<In>(d[k], v);
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = fr[k];
      if constexpr (R != kNone) *reinterpret_cast<uint2*>(er.data + (row0 + r0 + k) * p.K + col0 + c0) = encode8<kPlain>(v, f, er.fp8);
      if constexpr (C != kNone) q[k] = encode8<kPlain>(v, fc, ec.fp8);
    }
  };
  if (plain) encode(std::true_type{});
  else encode(std::false_type{});
  if constexpr (C == kMX) {  // MXFP8 keeps x's (M, K) layout
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

template <class In, int R, int C>
void launch(const TileParams& p, void* stream) {
  const int64_t tiles = (p.M / kTile) * (p.K / kTile);
  register_tile_kernel<In, R, C><<<unsigned(tiles), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
}

}  // namespace register_tile
#endif

}  // namespace gq
