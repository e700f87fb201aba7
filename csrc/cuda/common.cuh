// Element and block numerics shared by every kernel, written once for device and host.
//
// Each function is the scalar form of a step in graphquant/formats/*.py, in the same order and
// with the same IEEE fp32 operations, so a kernel is bit-identical to the reference as long as it
// is built without fast-math, without flush-to-zero and without FMA contraction (setup.py).
// The functions are __host__ __device__ so that tests can run the same code on the CPU.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include "params.h"

#if defined(__CUDACC__)
#include <cuda_fp8.h>
#endif

#if defined(__CUDACC__)
#define GQ_HD __host__ __device__ __forceinline__
#else
#define GQ_HD inline
#endif

namespace gq {

#if defined(__CUDACC__)
using Vec16 = uint4;
using Vec8 = uint2;
#else
struct alignas(16) Vec16 { uint32_t x, y, z, w; };
struct alignas(8) Vec8 { uint32_t x, y; };
#endif

constexpr float kFltMax = 3.40282346638528859812e+38f;

GQ_HD uint32_t f2u(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

GQ_HD float u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

GQ_HD bool is_nan(float f) { return (f2u(f) & 0x7FFFFFFFu) > 0x7F800000u; }
GQ_HD bool is_inf(float f) { return (f2u(f) & 0x7FFFFFFFu) == 0x7F800000u; }

// |f| as bits: for non-negative floats the unsigned order is the float order, and every NaN is
// above +inf, so max over these bits is an amax that propagates NaN like torch's amax.
GQ_HD uint32_t abs_bits(float f) { return f2u(f) & 0x7FFFFFFFu; }
GQ_HD uint32_t umax(uint32_t a, uint32_t b) { return a > b ? a : b; }

// Two unsigned 16-bit maxima at once.
GQ_HD uint32_t umax_halves(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __vmaxu2(a, b);
#else
  return umax(a & 0xFFFFu, b & 0xFFFFu) | (umax(a >> 16, b >> 16) << 16);
#endif
}

// torch.clamp: NaN passes through.
GQ_HD float clamp_nan(float v, float lo, float hi) {
  if (is_nan(v)) return v;
  return v < lo ? lo : (v > hi ? hi : v);
}

// torch.minimum: a NaN operand wins.
GQ_HD float min_nan(float a, float b) {
  if (is_nan(a)) return a;
  if (is_nan(b)) return b;
  return a < b ? a : b;
}

// -- input element types (the tile stores raw bits; conversions are torch's own) ----------------

struct InBF16 {
  using S = uint16_t;
  GQ_HD static float to_float(S b) { return u2f(uint32_t(b) << 16); }
  GQ_HD static S from_float(float f) { return c10::BFloat16(f).x; }
};

struct InF16 {
  using S = uint16_t;
  GQ_HD static float to_float(S b) { return static_cast<float>(c10::Half(b, c10::Half::from_bits())); }
  GQ_HD static S from_float(float f) { return c10::Half(f).x; }
};

struct InF32 {
  using S = float;
  GQ_HD static float to_float(S f) { return f; }
  GQ_HD static S from_float(float f) { return f; }
};

// -- FP8 (formats/fp8.py) ------------------------------------------------------------------------

enum Fp8Kind { kE4M3 = 0, kE5M2 = 1 };

GQ_HD float fp8_max(int kind) { return kind == kE4M3 ? 448.0f : 57344.0f; }

// cast_to_fp8 of a pair: clamp to +-max (NaN stays), then round to nearest even; the low byte
// holds `lo`. The GPU uses the conversion instruction, which agrees with torch's conversion on
// every non-NaN input; a NaN gets torch's encoding (0x7F with the input's sign) explicitly.
GQ_HD uint16_t fp8_encode2(float lo, float hi, int kind) {
  const float limit = fp8_max(kind);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const float2 ab = make_float2(fminf(fmaxf(lo, -limit), limit), fminf(fmaxf(hi, -limit), limit));
  uint16_t r = __nv_cvt_float2_to_fp8x2(ab, __NV_SATFINITE, kind == kE4M3 ? __NV_E4M3 : __NV_E5M2);
  if (is_nan(lo)) r = uint16_t((r & 0xFF00u) | 0x7Fu | ((f2u(lo) >> 24) & 0x80u));
  if (is_nan(hi)) r = uint16_t((r & 0x00FFu) | ((0x7Fu | ((f2u(hi) >> 24) & 0x80u)) << 8));
  return r;
#else
  const float a = clamp_nan(lo, -limit, limit), b = clamp_nan(hi, -limit, limit);
  const uint8_t qa = kind == kE4M3 ? c10::Float8_e4m3fn(a).x : c10::Float8_e5m2(a).x;
  const uint8_t qb = kind == kE4M3 ? c10::Float8_e4m3fn(b).x : c10::Float8_e5m2(b).x;
  return uint16_t(qa | (qb << 8));
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// The conversion alone, for pairs that are not NaN: SATFINITE rounds to nearest even and takes
// anything past +-max (inf included) to +-max, which is what clamping first and rounding gives.
template <__nv_fp8_interpretation_t kKind>
__device__ __forceinline__ void fp8_convert16(const float v[16], float scale, uint8_t q[16]) {
#pragma unroll
  for (int i = 0; i < 16; i += 2) {
    const uint16_t pair = __nv_cvt_float2_to_fp8x2(make_float2(v[i] * scale, v[i + 1] * scale), __NV_SATFINITE, kKind);
    q[i] = uint8_t(pair);
    q[i + 1] = uint8_t(pair >> 8);
  }
}
#endif

// cast_to_fp8(v * scale) for 16 values whose |v| is at most `amax_bits` (fp32 bits). A product
// can be NaN only when some v is NaN or the scale is not a positive finite number; otherwise the
// GPU takes the plain conversion, which needs neither the clamp nor the NaN sign fix.
GQ_HD void fp8_encode16(const float v[16], float scale, int kind, uint8_t q[16], uint32_t amax_bits) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (amax_bits <= 0x7F800000u && scale > 0.0f && scale <= kFltMax) {
    if (kind == kE4M3) fp8_convert16<__NV_E4M3>(v, scale, q);
    else fp8_convert16<__NV_E5M2>(v, scale, q);
    return;
  }
#else
  (void)amax_bits;
#endif
#pragma unroll
  for (int i = 0; i < 16; i += 2) {
    const uint16_t pair = fp8_encode2(v[i] * scale, v[i + 1] * scale, kind);
    q[i] = uint8_t(pair);
    q[i + 1] = uint8_t(pair >> 8);
  }
}

// Exact: every FP8 value is a half; the GPU converts through f16 with one instruction.
GQ_HD float fp8_decode(uint8_t b, int kind) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const __half_raw h = __nv_cvt_fp8_to_halfraw(b, kind == kE4M3 ? __NV_E4M3 : __NV_E5M2);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.x));
  return f;
#else
  return kind == kE4M3 ? static_cast<float>(c10::Float8_e4m3fn(b, c10::Float8_e4m3fn::from_bits()))
                       : static_cast<float>(c10::Float8_e5m2(b, c10::Float8_e5m2::from_bits()));
#endif
}

// scale_from_amax (TE's compute_scale_from_amax).
GQ_HD float scale_from_amax(float amax, int kind, float epsilon, bool pow2) {
  const float a = amax < epsilon ? epsilon : amax;
  float scale = fp8_max(kind) / a;
  if (is_inf(scale)) scale = kFltMax;
  if (is_nan(scale)) scale = 1.0f;
  if (a == 0.0f || is_inf(a)) scale = 1.0f;
  if (pow2) scale = u2f(f2u(scale) & 0xFF800000u);
  return scale;
}

// -- MXFP8 (formats/mxfp8.py) --------------------------------------------------------------------

GQ_HD uint8_t e8m0_from_amax(float amax, int kind) {
  const uint32_t bits = f2u(amax / fp8_max(kind)) & 0x7FFFFFFFu;
  if (bits > 0x7F800000u) return 255;
  const uint32_t exponent = bits >> 23, mantissa = bits & 0x7FFFFFu;
  if (exponent == 0) return mantissa > 0x400000u ? 1 : 0;
  const uint32_t biased = exponent + (mantissa != 0);
  return biased > 254 ? 254 : uint8_t(biased);
}

GQ_HD float mx_encode_multiplier(uint8_t biased) {
  if (biased == 0) return 1.0f;
  if (biased == 255) return u2f(0x7FC00000u);
  if (biased == 254) return u2f(0x00400000u);
  return u2f(uint32_t(254 - biased) << 23);
}

GQ_HD float mx_decode_scale(uint8_t biased) {
  if (biased == 0) return u2f(0x00400000u);
  if (biased == 255) return u2f(0x7FC00000u);
  return u2f(uint32_t(biased) << 23);
}

// -- NVFP4 (formats/nvfp4.py) --------------------------------------------------------------------

struct NvGlobal {
  float mult;   // S_enc * fp32(1/6)
  float s_dec;  // 1 / S_enc
  float g_dec;  // amax / 2688, the dequantize factor
};

GQ_HD NvGlobal nv_global(float amax) {
  float s_enc = min_nan(2688.0f / amax, kFltMax);
  if (s_enc == 0.0f || amax == 0.0f) s_enc = 1.0f;
  return {s_enc * u2f(0x3E2AAAABu), 1.0f / s_enc, amax / 2688.0f};
}

GQ_HD uint8_t nv_block_scale(float vec_max, float mult) {
  return c10::Float8_e4m3fn(clamp_nan(vec_max * mult, -448.0f, 448.0f)).x;
}

GQ_HD float e4m3_value(uint8_t b) { return fp8_decode(b, kE4M3); }

// min(1 / (fp32(s) * S_dec), FLT_MAX)
GQ_HD float nv_encode_factor(uint8_t scale, float s_dec) {
  const float denom = e4m3_value(scale) * s_dec;
  return min_nan(1.0f / denom, kFltMax);
}

// The sign of the E2M1 code of a product the kernel computed: bit 31 set for a negative value, -0
// included, and clear for NaN (which gets +6's code 0x7), the other bits those of the product. On
// the GPU a NaN product is the canonical 0x7FFFFFFF (CUDA's single-precision operations return
// that one quiet NaN), so the product's own bits serve, where a test takes two instructions more;
// the host, whose NaNs keep their signs, tests: the negative floats that are not NaN run from
// 0x80000000 (-0) to 0xFF800000 (-inf).
GQ_HD uint32_t e2m1_signed(float product) {
#if defined(__CUDA_ARCH__)
  return f2u(product);
#else
  return f2u(product) - 0x80000000u <= 0x7F800000u ? f2u(product) : f2u(product) & 0x7FFFFFFFu;
#endif
}

// The code of magnitude index i (0..7, the low bits of i) under that sign: bit 3 from the sign's
// top four bits. On the GPU a shift and one LOP3 (a bit select, which ptxas does not find once it
// has turned ~0x7 into 0x8), the code then declared below 16 so that packing needs no mask.
GQ_HD uint32_t e2m1_code_of(uint32_t signed_bits, uint32_t i) {
#if defined(__CUDA_ARCH__)
  uint32_t code;
  asm("lop3.b32 %0, %1, %2, 7, 0xD8;" : "=r"(code) : "r"(signed_bits >> 28), "r"(i));  // (a & ~c) | (b & c)
  __builtin_assume(code < 16u);
  return code;
#else
  return ((signed_bits >> 28) & ~0x7u) | (i & 0x7u);
#endif
}

// min(|v|, 6), and 6 for every NaN (the comparison fails; a host fminf keeps a signaling NaN).
GQ_HD float e2m1_clamp(float v) { return fabsf(v) < 6.0f ? fabsf(v) : 6.0f; }

// The grid value of magnitude index i (0, .5, 1, 1.5, 2, 3, 4, 6). On the GPU twice it is byte i
// of 0x0C08060403020100, one byte permute: ptxas makes the selects a table in local memory, whose
// stack frame and spills would burden the register tile program's dequantized sources.
GQ_HD float e2m1_magnitude(int i) {
#if defined(__CUDA_ARCH__)
  return 0.5f * float(__byte_perm(0x03020100u, 0x0C080604u, unsigned(i)));
#else
  return i < 4 ? 0.5f * float(i) : (i < 7 ? float(i - 2) : 6.0f);
#endif
}

// Round to nearest even in one fp32 addition, of a = e2m1_clamp(v), v a product the kernel computed.
// Around a the grid step is 2^(E-128), E = max(exponent field of a, 127): 0.5 below 2, then 1, then
// 2. M = 2^23 * step has the step as its ulp, so a + M rounds a to the grid with ties to even; M also
// carries 2(E-127) steps in its mantissa (the codes below 2^(E-127)), so the sum's mantissa is the
// code, whose parity is the rounded mantissa's: ties go to the even code.
// Also gives the grid value the code stands for, sign included: the sum minus M, exact (both are
// multiples of the step), where decoding the code again would take five instructions.
struct E2m1Rounded {
  uint8_t code;
  float value;  // e2m1_value(code)
};
GQ_HD E2m1Rounded e2m1_round_nearest(float v) {
  const float a = e2m1_clamp(v);
  const uint32_t e = umax(f2u(a) >> 23, 127u);
  const float m = u2f(((e + 22) << 23) + 2 * (e - 127));
  const float sum = a + m;
  const uint32_t sign = e2m1_signed(v);
  return {uint8_t(e2m1_code_of(sign, f2u(sum))), u2f(f2u(sum - m) | (sign & 0x80000000u))};
}

GQ_HD uint8_t e2m1_nearest(float v) { return e2m1_round_nearest(v).code; }

// Stochastic rounding: up iff u * (hi - lo) < a - lo with u = (rand >> 8) * 2^-24, i.e. the code is
// ceil(pos - u) for a's position pos on the grid (index of lo plus the fraction of the gap: 2.5 ->
// 4.5). With p = ceil(2^24 pos) that is ceil((p - (rand >> 8)) / 2^24), exact in uint32. From 1 up a
// gap is half a binade, so p = 4 (bits(a) - bits(0.5)); below 1, p = ceil(2^25 a) (the conversion is
// exact, and rounding up changes nothing for the integer rand >> 8).
GQ_HD uint8_t e2m1_stochastic(float v, uint32_t rand) {
  const float a = e2m1_clamp(v);
  const uint32_t p = a >= 1.0f ? (f2u(a) - 0x3F000000u) << 2 : uint32_t(ceilf(a * 33554432.0f));  // 2^25
  return uint8_t(e2m1_code_of(e2m1_signed(v), (p + (~rand >> 8)) >> 24));
}

GQ_HD float e2m1_value(uint8_t code) {
  const float m = e2m1_magnitude(code & 0x7);
  return (code & 0x8) ? -m : m;
}

// -- random bits (nvfp4.random_bits): splitmix32 keyed by (seed, offset, stream) ----------------

GQ_HD uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// The key of a stream (kernels.sr_key): the hash of (seed, offset, stream) in 32-bit words.
constexpr uint64_t kStreamsPerStep = 1ull << 16;  // graphquant.quantizers.STREAMS_PER_STEP

GQ_HD uint32_t sr_key(uint64_t seed, uint64_t offset, uint32_t stream) {
  const uint32_t words[5] = {uint32_t(seed), uint32_t(seed >> 32), uint32_t(offset), uint32_t(offset >> 32), stream};
  uint32_t key = 0x6A09E667u;  // nvfp4._HASH_IV
#pragma unroll
  for (int i = 0; i < 5; ++i) key = fmix32(key ^ words[i]);
  return key;
}

// The hash takes the 64-bit index in halves: random_stream(key, index >> 32) is shared by every index
// with the same high half, so a caller drawing consecutive indices (nv_encode: 16 per chunk) computes
// it once and only random_bits_at(stream, uint32_t(index)) per element. random_bits is the composition
// (the one definition of the hash).
GQ_HD uint32_t random_stream(uint32_t key, uint32_t index_hi) { return fmix32(key ^ index_hi); }

GQ_HD uint32_t random_bits_at(uint32_t stream, uint32_t index_lo) { return fmix32(stream + index_lo * 0x9E3779B9u); }

GQ_HD uint32_t random_bits(uint32_t key, uint64_t index) {
  return random_bits_at(random_stream(key, uint32_t(index >> 32)), uint32_t(index));
}

// The stochastic-rounding key of an encoder: made here from the device's [seed, step] where the
// call passed them (so the host never reads them), else the host's.
GQ_HD uint32_t sr_key_of(const Encoder& e) {
  if (!e.sr || !e.rng) return e.key;
  return sr_key(uint64_t(e.rng[0]), uint64_t(e.rng[1]) * kStreamsPerStep + uint64_t(e.rng_offset), uint32_t(e.key_stream));
}

// -- random Hadamard transform of one 16-element chunk (nvfp4.hadamard_transform) ---------------

constexpr uint32_t kRhtNegative =
    (1u << 3) | (1u << 5) | (1u << 6) | (1u << 7) | (1u << 8) | (1u << 9) | (1u << 10) | (1u << 12) | (1u << 14) | (1u << 15);

// The chunk's elements first .. first + N - 1 in y, their signs flipped by the random sign mask,
// then hadamard16's butterflies of strides 1 .. N / 2 in its order (all of them for N = 16; the
// register program's half chunks take the last one across lanes).
template <int N>
GQ_HD void hadamard_steps(float y[N], int first, bool sign_mask) {
  if (sign_mask) {
#pragma unroll
    for (int j = 0; j < N; ++j) y[j] = y[j] * ((kRhtNegative >> (first + j)) & 1 ? -1.0f : 1.0f);
  }
#pragma unroll
  for (int h = 1; h < N; h <<= 1) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if ((j & h) == 0) {
        const float a = y[j], b = y[j + h];
        y[j] = a + b;
        y[j + h] = a - b;
      }
    }
  }
}

// The transformed values rounded to the input's dtype, as the reference rounds them.
template <class In>
GQ_HD float rounded_to(float v) { return In::to_float(In::from_float(v)); }

template <class In>
GQ_HD void hadamard16(float y[16], bool sign_mask) {
  hadamard_steps<16>(y, 0, sign_mask);
#pragma unroll
  for (int j = 0; j < 16; ++j) y[j] = rounded_to<In>(y[j] * 0.25f);
}

// -- row groups ------------------------------------------------------------------------------

// The group of `row` in a grouped launch (TileParams::group_start): the last group starting at or
// before it, which skips empty groups.
GQ_HD int group_of(const TileParams& p, int64_t row) {
  int lo = 0, hi = p.G - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.group_start[mid] <= row) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// -- atomics and block reductions, with a sequential meaning on the host ------------------------

GQ_HD void atomic_umax(uint32_t* address, uint32_t value) {
#if defined(__CUDA_ARCH__)
  atomicMax(address, value);
#else
  if (value > *address) *address = value;
#endif
}

// Max of `value` over the calling threads into a shared word; every lane of each warp must call.
GQ_HD void block_umax(uint32_t* shared, uint32_t value) {
#if defined(__CUDA_ARCH__)
  value = __reduce_max_sync(0xFFFFFFFFu, value);
  if ((threadIdx.x & 31) == 0) atomicMax(shared, value);
#else
  if (value > *shared) *shared = value;
#endif
}

// -- 16-element chunks of x as stored: sizeof(S) 16-byte words ---------------------------------

template <class In>
GQ_HD void unpack_chunk(const Vec16* words, float v[16]) {
  using S = typename In::S;
#pragma unroll
  for (int w = 0; w < int(sizeof(S)); ++w) {
    const Vec16 q = words[w];
    const uint32_t u[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (sizeof(S) == 2) {
        v[8 * w + 2 * k] = In::to_float(S(u[k] & 0xFFFFu));
        v[8 * w + 2 * k + 1] = In::to_float(S(u[k] >> 16));
      } else {
        v[4 * w + k] = u2f(u[k]);
      }
    }
  }
}

GQ_HD uint32_t chunk_amax(const float v[16]) {
  uint32_t m = 0;
#pragma unroll
  for (int e = 0; e < 16; ++e) m = umax(m, abs_bits(v[e]));
  return m;
}

// chunk_amax of a stored chunk: |x|'s bits order bf16 and f16 values as their magnitudes do (NaN
// above inf), so two elements compare at once and only the maximum converts.
template <class In>
GQ_HD uint32_t stored_chunk_amax(const Vec16* words) {
  using S = typename In::S;
  if constexpr (sizeof(S) == 2) {
    uint32_t m = 0;
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const Vec16 q = words[w];
      m = umax_halves(m, umax_halves(q.x & 0x7FFF7FFFu, q.y & 0x7FFF7FFFu));
      m = umax_halves(m, umax_halves(q.z & 0x7FFF7FFFu, q.w & 0x7FFF7FFFu));
    }
    return abs_bits(In::to_float(S(umax(m & 0xFFFFu, m >> 16))));
  } else {
    float v[16];
    unpack_chunk<In>(words, v);
    return chunk_amax(v);
  }
}

GQ_HD Vec16 pack16(const uint8_t q[16]) {
  Vec16 v;
  v.x = q[0] | (q[1] << 8) | (q[2] << 16) | (uint32_t(q[3]) << 24);
  v.y = q[4] | (q[5] << 8) | (q[6] << 16) | (uint32_t(q[7]) << 24);
  v.z = q[8] | (q[9] << 8) | (q[10] << 16) | (uint32_t(q[11]) << 24);
  v.w = q[12] | (q[13] << 8) | (q[14] << 16) | (uint32_t(q[15]) << 24);
  return v;
}

// 16 E2M1 codes -> 8 bytes, element 2k in the low nibble (nvfp4.pack).
GQ_HD Vec8 pack_e2m1(const uint8_t c[16]) {
  Vec8 v;
  v.x = v.y = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) v.x |= uint32_t(c[2 * k] | (c[2 * k + 1] << 4)) << (8 * k);
#pragma unroll
  for (int k = 0; k < 4; ++k) v.y |= uint32_t(c[8 + 2 * k] | (c[8 + 2 * k + 1] << 4)) << (8 * k);
  return v;
}


}  // namespace gq
