// Row-scaled FP8's rowwise side in one launch: each warp holds a whole row of x in its registers,
// takes the row's amax by warp shuffles, and encodes the row from those registers with the scale
// that amax gives. The tile programs need an amax pre-pass over x, a launch for the scales and
// a main pass that reads x again: twice the reads of x and three launches. Optionally the same
// read takes the per-group column amaxes that the column side scales from (an expert stack's
// weights: rowwise in forward, columnwise in backward from those amaxes).
//
// A CTA takes a tile's 128 rows (16 a warp), all in one group; in a padded layout (p.runs) a run
// of x's rows and then zero rows, or rows read through a gather (p.rows). Lane l holds the row's
// 16-byte words l, l + 32, ..., so a warp's loads and its code stores are contiguous runs, and a
// lane's columns are the same in every row: it keeps their maxima in registers, and the CTA's
// warps meet only once, at the end, to max them together in shared memory before one atomic max
// per column into the group's.
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

constexpr int kThreads = 256, kRows = 128, kRowsAWarp = kRows / (kThreads / 32), kShortWords = 8;

// kWords: the 16-byte words a lane holds of a row (rows of up to 256 * kWords 2-byte elements);
// kShortWords for short rows, whose fewer registers let two CTAs share an SM and so keep more
// loads in flight (an expert stack's down projection weights, K = 1408).
template <class In, bool kColumnAmax, int kWords>
__global__ void __launch_bounds__(kThreads, 1) row_strip_kernel(const TileParams p) {
  __shared__ uint32_t column_amax[kColumnAmax ? kMaxColumns : 1];  // fp32 bits
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const int64_t row0 = int64_t(blockIdx.x) * kRows;
  const int words = int(p.K / 8);  // 16-byte words of a row
  const int64_t first_row = p.runs != nullptr ? p.runs[2 * blockIdx.x] : row0;
  const int64_t rows_in = p.runs != nullptr ? p.runs[2 * blockIdx.x + 1] : p.M - row0;
  if constexpr (kColumnAmax) {
    for (int c = int(threadIdx.x); c < p.K; c += kThreads) column_amax[c] = 0;
    __syncthreads();
  }
  uint32_t cm[kColumnAmax ? 4 * kWords : 1];  // the lane's columns' maxima, |x| halves packed in pairs
#pragma unroll
  for (int i = 0; i < (kColumnAmax ? 4 * kWords : 1); ++i) cm[i] = 0;

  for (int i = 0; i < kRowsAWarp; ++i) {
    const int r = warp * kRowsAWarp + i;
    const int64_t row = row0 + r;
    if (row >= p.M) break;
    const int64_t source = p.rows != nullptr ? p.rows[row] : first_row + r;  // through a gather: -1 a zero row
    const bool in = p.rows != nullptr ? source >= 0 : r < rows_in;
    const uint4* x = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.x) + (in ? source : 0) * p.K);
    uint4 d[kWords];
#pragma unroll
    for (int j = 0; j < kWords; ++j) d[j] = in && lane + 32 * j < words ? __ldcs(x + lane + 32 * j) : make_uint4(0, 0, 0, 0);
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < kWords; ++j) {
      const uint32_t u[4] = {d[j].x & kMagnitudes, d[j].y & kMagnitudes, d[j].z & kMagnitudes, d[j].w & kMagnitudes};
      m = umax_halves(m, umax_halves(umax_halves(u[0], u[1]), umax_halves(u[2], u[3])));
      if constexpr (kColumnAmax) {
#pragma unroll
        for (int k = 0; k < 4; ++k) cm[4 * j + k] = umax_halves(cm[4 * j + k], u[k]);
      }
    }
    m = fold(m);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) m = umax(m, __shfl_xor_sync(kWarp, m, offset));
    const uint32_t amax = amax_bits<In>(m);
    const float scale = scale_from_amax(u2f(amax), p.row.fp8, p.row.epsilon, p.row.pow2);
    if (lane == 0) static_cast<float*>(p.row.scales)[row] = 1.0f / scale;
    float f[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = scale;
    const bool plain = amax <= 0x7F800000u && usable(scale);  // as the tile programs' rule: no product is NaN
    uint2* out = reinterpret_cast<uint2*>(p.row.data + row * p.K);
#pragma unroll
    for (int j = 0; j < kWords; ++j) {
      if (lane + 32 * j >= words) break;
      float v[8];
      unpack8<In>(d[j], v);
      out[lane + 32 * j] = plain ? encode8<true>(v, f, p.row.fp8) : encode8<false>(v, f, p.row.fp8);
    }
  }

  if constexpr (kColumnAmax) {
#pragma unroll
    for (int j = 0; j < kWords; ++j) {
      if (lane + 32 * j >= words) break;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int c = 8 * (lane + 32 * j) + 2 * k;
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

template <class In, bool kColumnAmax>
void launch(const TileParams& p, void* stream) {
  const unsigned ctas = unsigned((p.M + kRows - 1) / kRows);
  auto* kernel = p.K <= 256 * kShortWords ? row_strip_kernel<In, kColumnAmax, kShortWords> : row_strip_kernel<In, kColumnAmax, kMaxWords>;
  kernel<<<ctas, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
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
  const bool shape = p.M > 0 && p.K > 0 && p.K <= kMaxColumns && p.K % 8 == 0 && p.vec_load &&
                     (p.M + row_strip::kRows - 1) / row_strip::kRows <= INT32_MAX;
  if (!row_strip::enabled() || !shape || (dtype != kBF16 && dtype != kF16)) return false;
  const bool columns = p.acc.cols != nullptr;
  if (dtype == kBF16) (columns ? row_strip::launch<InBF16, true> : row_strip::launch<InBF16, false>)(p, stream);
  else (columns ? row_strip::launch<InF16, true> : row_strip::launch<InF16, false>)(p, stream);
  check_launch("row strip quantize");
  return true;
}

}  // namespace gq
