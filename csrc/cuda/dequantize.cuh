// Dequantize one stored representation to bf16/fp16/fp32, 16 elements of a stored row per thread,
// with the reference's operations (formats/*.py dequantize), then the rounding of .to(dtype).
#pragma once

#include "common.cuh"
#include "params.h"

namespace gq {

template <class Out>
GQ_HD void store_values(const DequantParams& p, int64_t r, int64_t c0, const float v[16]) {
  using S = typename Out::S;
  S* dst = static_cast<S*>(p.out) + r * p.cols + c0;
  if (c0 + 16 <= p.cols && (p.cols * int64_t(sizeof(S))) % 16 == 0) {
    Vec16* out = reinterpret_cast<Vec16*>(dst);
    if constexpr (sizeof(S) == 2) {
      uint32_t u[8];
      for (int k = 0; k < 8; ++k) u[k] = uint32_t(Out::from_float(v[2 * k])) | (uint32_t(Out::from_float(v[2 * k + 1])) << 16);
      out[0] = Vec16{u[0], u[1], u[2], u[3]};
      out[1] = Vec16{u[4], u[5], u[6], u[7]};
    } else {
      for (int w = 0; w < 4; ++w) out[w] = Vec16{f2u(v[4 * w]), f2u(v[4 * w + 1]), f2u(v[4 * w + 2]), f2u(v[4 * w + 3])};
    }
    return;
  }
  for (int i = 0; i < 16 && c0 + i < p.cols; ++i) dst[i] = Out::from_float(v[i]);
}

template <class Out>
GQ_HD void dequantize_chunk(const DequantParams& p, int64_t chunk) {
  const int64_t per_row = (p.cols + 15) / 16;
  const int64_t r = chunk / per_row, c0 = (chunk % per_row) * 16;
  if (r >= p.rows) return;
  float v[16];
  if (p.kind == kDequantNV) {  // (e2m1 * fp32(s)) * (amax / 2688); cols is a multiple of 16
    const Vec8 w = *reinterpret_cast<const Vec8*>(p.data + r * (p.cols / 2) + c0 / 2);
    const float s = e4m3_value(static_cast<const uint8_t*>(p.scales)[r * (p.cols / 16) + c0 / 16]);
    const float g = p.amax ? u2f(p.amax[p.nv_row_amax ? r : 0]) / 2688.0f : 1.0f;
    for (int i = 0; i < 16; ++i) {
      const uint32_t word = i < 8 ? w.x : w.y;
      const uint8_t code = uint8_t((word >> (4 * (i & 7))) & 0xF);
      v[i] = e2m1_value(code) * s;
      if (p.amax) v[i] = v[i] * g;
    }
  } else {
    uint8_t q[16] = {};
    const uint8_t* src = p.data + r * p.cols + c0;
    if (c0 + 16 <= p.cols && (p.cols & 15) == 0) {
      const Vec16 w = *reinterpret_cast<const Vec16*>(src);
      const uint32_t u[4] = {w.x, w.y, w.z, w.w};
      for (int i = 0; i < 16; ++i) q[i] = uint8_t(u[i >> 2] >> (8 * (i & 3)));
    } else {
      for (int i = 0; i < 16 && c0 + i < p.cols; ++i) q[i] = src[i];
    }
    // Blocks are 1 column wide (MXFP8's 32x1) or a multiple of 16 (or the whole row), so a chunk
    // has one scale or one a column; the divisions (64-bit, by runtime values) stay per chunk.
    const int64_t row_at = (r / p.block_rows) * p.scale_row_stride;
    const int64_t chunk_at = row_at + (c0 / p.block_cols) * p.scale_col_stride;
    for (int i = 0; i < 16; ++i) {
      const int64_t c = c0 + i < p.cols ? c0 + i : p.cols - 1;  // keep scale reads in bounds
      const int64_t at = p.block_cols == 1 ? row_at + c * p.scale_col_stride : chunk_at;
      const float scale = p.kind == kDequantMX ? mx_decode_scale(static_cast<const uint8_t*>(p.scales)[at])
                                               : static_cast<const float*>(p.scales)[at];
      v[i] = fp8_decode(q[i], p.fp8) * scale;
    }
  }
  store_values<Out>(p, r, c0, v);
}

}  // namespace gq
