// What follows a tile pass: scales from the accumulated amaxes, and the bias-gradient reduction.
#pragma once

#include "common.cuh"
#include "params.h"

namespace gq {

// Per-tensor (per group) or per-row/column FP8 scales from an amax: scale_from_amax, then
// scale_inv = reciprocal(scale) as the representation stores it.
GQ_HD void finalize_one(const FinalizeParams& p, int64_t i) {
  if (i >= p.n) return;
  const float scale = scale_from_amax(u2f(p.amax[i]), p.fp8, p.epsilon, p.pow2 != 0);
  p.scale[i] = scale;
  p.scale_inv[i] = 1.0f / scale;
}

// dbias[c] = sum over tiles of the per-tile column sums, in tile order (deterministic), in x's dtype.
template <class In>
GQ_HD void dbias_one(const DbiasParams& p, int64_t c) {
  if (c >= p.K) return;
  float sum = 0.0f;
  for (int64_t t = 0; t < p.tiles; ++t) sum += p.partial[t * p.K + c];
  static_cast<typename In::S*>(p.out)[c] = In::from_float(sum);
}

}  // namespace gq
