// Row-scaled FP8's rowwise side in one launch: each warp holds a whole row of x in its registers,
// takes the row's amax by warp shuffles, and encodes the row from those registers with the scale
// that amax gives. The tile programs need an amax pre-pass over x, a launch for the scales and
// a main pass that reads x again: twice the reads of x and three launches. Optionally the same
// read takes the per-group column amaxes that the column side scales from (an expert stack's
// weights: rowwise in forward, columnwise in backward from those amaxes).
//
// A CTA takes a tile's 128 rows (16 a warp), all in one group; in a padded layout (p.runs) a run
// of x's rows and then zero rows. A warp's 32 x 16 slots of 16-byte words hold one row, or two or
// four short ones, in order (lane l's slot j is word l + 32 j of them), so a warp's loads and its
// code stores are contiguous runs, and a slot's columns are the same in every step: the lane
// keeps their maxima in registers, and the CTA's warps meet only once, at the end, to max them
// together in shared memory before one atomic max per column into the group's.
#include <climits>
#include <cstdlib>
#include <string>

#include "launch.cuh"
#include "register_tile.cuh"
#include "row_strip.h"

namespace gq {
namespace row_strip {

using register_tile::amax_bits;
using register_tile::encode8;
using register_tile::fold;
using register_tile::kMagnitudes;
using register_tile::kWarp;
using register_tile::unpack8;
using register_tile::usable;

constexpr int kThreads = 256, kRows = 128, kRowsAWarp = kRows / (kThreads / 32);

// Rows a warp holds at once: as many whole rows of `words` 16-byte words as its slots take, up to
// four (each a divisor of kRowsAWarp), so that short rows keep as many loads in flight as long ones.
inline int rows_held(int64_t words) { return 4 * words <= 32 * kMaxWords ? 4 : 2 * words <= 32 * kMaxWords ? 2 : 1; }

// Where slot `s` (word s of the warp's 32 x kMaxWords) lies among the kHeld rows the warp holds:
// row q's 16-byte word w.
struct Slot {
  int q, w;
};
template <int kHeld>
__device__ __forceinline__ Slot slot_of(int s, int words) {
  int q = 0;
#pragma unroll
  for (int i = 1; i < kHeld; ++i) q += int(s >= i * words);
  return {q, s - q * words};
}

template <class In, bool kColumnAmax, int kHeld>
__global__ void __launch_bounds__(kThreads, 1) row_strip_kernel(const TileParams p) {
  __shared__ uint32_t column_amax[kColumnAmax ? kMaxColumns : 1];  // fp32 bits
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const int64_t row0 = int64_t(blockIdx.x) * kRows;
  const int words = int(p.K / 8);  // 16-byte words of a row
  const int64_t first_row = p.runs != nullptr ? p.runs[2 * blockIdx.x] : row0;
  const int64_t rows_in = p.runs != nullptr ? p.runs[2 * blockIdx.x + 1] : p.M - row0;
  const uint4* x = static_cast<const uint4*>(p.x);
  uint2* out = reinterpret_cast<uint2*>(p.row.data);
  if constexpr (kColumnAmax) {
    for (int c = int(threadIdx.x); c < p.K; c += kThreads) column_amax[c] = 0;
    __syncthreads();
  }
  // The lane's columns' maxima (|x| halves packed in pairs): a slot's columns are the same in every step.
  uint32_t cm[kColumnAmax ? 4 * kMaxWords : 1];
#pragma unroll
  for (int i = 0; i < (kColumnAmax ? 4 * kMaxWords : 1); ++i) cm[i] = 0;

  for (int first = warp * kRowsAWarp; first < (warp + 1) * kRowsAWarp && row0 + first < p.M; first += kHeld) {
    uint4 d[kMaxWords];
#pragma unroll
    for (int j = 0; j < kMaxWords; ++j) {
      const Slot s = slot_of<kHeld>(lane + 32 * j, words);
      const int r = first + s.q;
      d[j] = s.w < words && r < rows_in ? __ldcs(x + (first_row + r) * words + s.w) : make_uint4(0, 0, 0, 0);
    }
    uint32_t m[kHeld] = {};  // each held row's amax (the lane's part); empty slots hold zeros
#pragma unroll
    for (int j = 0; j < kMaxWords; ++j) {
      const Slot s = slot_of<kHeld>(lane + 32 * j, words);
      const uint32_t u[4] = {d[j].x & kMagnitudes, d[j].y & kMagnitudes, d[j].z & kMagnitudes, d[j].w & kMagnitudes};
      const uint32_t word_max = umax_halves(umax_halves(u[0], u[1]), umax_halves(u[2], u[3]));
#pragma unroll
      for (int q = 0; q < kHeld; ++q) m[q] = s.q == q ? umax_halves(m[q], word_max) : m[q];
      if constexpr (kColumnAmax) {
#pragma unroll
        for (int k = 0; k < 4; ++k) cm[4 * j + k] = umax_halves(cm[4 * j + k], u[k]);
      }
    }
    float scale[kHeld];
    bool plain[kHeld];  // as the tile programs' rule: no product can be NaN
#pragma unroll
    for (int q = 0; q < kHeld; ++q) {
      uint32_t amax = fold(m[q]);
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) amax = umax(amax, __shfl_xor_sync(kWarp, amax, offset));
      amax = amax_bits<In>(amax);
      scale[q] = scale_from_amax(u2f(amax), p.row.fp8, p.row.epsilon, p.row.pow2);
      plain[q] = amax <= 0x7F800000u && usable(scale[q]);
      if (lane == 0 && row0 + first + q < p.M) static_cast<float*>(p.row.scales)[row0 + first + q] = 1.0f / scale[q];
    }
#pragma unroll
    for (int j = 0; j < kMaxWords; ++j) {
      const Slot s = slot_of<kHeld>(lane + 32 * j, words);
      const int64_t row = row0 + first + s.q;
      if (s.w >= words || row >= p.M) continue;
      float held_scale = scale[0];
      bool as_is = plain[0];
#pragma unroll
      for (int q = 1; q < kHeld; ++q) {
        held_scale = s.q == q ? scale[q] : held_scale;
        as_is = s.q == q ? plain[q] : as_is;
      }
      float f[8], v[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] = held_scale;
      unpack8<In>(d[j], v);
      out[row * words + s.w] = as_is ? encode8<true>(v, f, p.row.fp8) : encode8<false>(v, f, p.row.fp8);
    }
  }

  if constexpr (kColumnAmax) {
#pragma unroll
    for (int j = 0; j < kMaxWords; ++j) {
      const Slot s = slot_of<kHeld>(lane + 32 * j, words);
      if (s.w >= words) continue;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int c = 8 * s.w + 2 * k;
        atomicMax(&column_amax[c], amax_bits<In>(cm[4 * j + k] & 0xFFFFu));
        atomicMax(&column_amax[c + 1], amax_bits<In>(cm[4 * j + k] >> 16));
      }
    }
    __syncthreads();
    const int g = p.group_start != nullptr ? group_of(p, row0) : 0;
    for (int c = int(threadIdx.x); c < p.K; c += kThreads) {
      if (column_amax[c] != 0) atomicMax(&p.acc.cols[int64_t(g) * p.K + c], column_amax[c]);
    }
  }
}

template <class In, bool kColumnAmax, int kHeld>
void launch(const TileParams& p, void* stream) {
  row_strip_kernel<In, kColumnAmax, kHeld><<<unsigned((p.M + kRows - 1) / kRows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
}

template <class In, bool kColumnAmax>
void launch_held(const TileParams& p, void* stream) {
  const int held = rows_held(p.K / 8);
  (held == 4 ? launch<In, kColumnAmax, 4> : held == 2 ? launch<In, kColumnAmax, 2> : launch<In, kColumnAmax, 1>)(p, stream);
}

// GRAPHQUANT_ROW_STRIP=0 sends these calls to the tile programs (the same bits): to compare them
// (benchmarks/grouped_quantize.py), or to rule this program out.
bool enabled() {
  static const bool on = [] {
    const char* value = std::getenv("GRAPHQUANT_ROW_STRIP");
    return value == nullptr || std::string(value) != "0";
  }();
  return on;
}

}  // namespace row_strip

bool launch_row_strip(int dtype, const TileParams& p, void* stream) {
  const bool shape = p.M > 0 && p.K > 0 && p.K <= kMaxColumns && p.K % 8 == 0 && p.vec_load && (p.M + 127) / 128 <= INT32_MAX;
  if (!row_strip::enabled() || !shape || (dtype != kBF16 && dtype != kF16)) return false;
  const bool columns = p.acc.cols != nullptr;
  if (dtype == kBF16) (columns ? row_strip::launch_held<InBF16, true> : row_strip::launch_held<InBF16, false>)(p, stream);
  else (columns ? row_strip::launch_held<InF16, true> : row_strip::launch_held<InF16, false>)(p, stream);
  check_launch("row strip quantize");
  return true;
}

}  // namespace gq
