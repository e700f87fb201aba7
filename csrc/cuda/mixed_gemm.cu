// graphquant._C.mixed_gemm: out (m, n) = alpha * (x @ w^T) (+ bias) for an MXFP8 or NVFP4 weight w
// (n, k) decoded in registers on Hopper's bf16 tensor cores, against x's values (m, k) already
// dequantized to bf16 (graphquant::mixed_input_operand, or graphquant.kernels.mixed_input.operand). Hopper has
// no tensor core for either format: the emulation dequantizes the whole weight to bf16 each call
// and multiplies it by cuBLAS, and the
// decode GEMM's Triton loop waits for its own decoding; here each warpgroup decodes the next K step
// of its 64 weight rows while the wgmma of this one runs, so the weight's bytes are read once, as
// stored, and the tensor cores wait less (benchmarks/NOTES.md, decode_gemm.py, has where it stands).
//
// Numerics: the emulation's. Every decoded value (E4M3 code times its E8M0 power of two, E2M1 code
// times its E4M3 block scale) is one correctly rounded bf16 product, exact where it is a bf16
// number, as graphquant.kernels.emulation's values are (NVFP4's held 2^-26 times, exactly: the sums
// are multiplied back, NVFP4_SUM_UNIT); the sums are fp32 (the tensor cores'
// order, and a K split's partial sums added in split order, so repeated calls give the same bits);
// alpha (NVFP4's global factors, each amax / divisor rounded once, their product rounded once, made
// here from the operands' amaxes) and the bias are applied to the fp32 sum before its one rounding.
//
// Layout: a CTA multiplies 128 weight rows (two warpgroups of 64, the wgmma's register operand) by
// TOKENS rows of x (the shared-memory operand, 128-byte swizzled) over K steps of 128 (64 for 256
// rows of x), through stages a third warpgroup fills by TMA. Each thread decodes 16 consecutive K
// of each of its two rows an atom (64 K) into the register operand's fragment, two codes of a word
// a bf16 pair (permuted), so x's values are stored with each 64-wide atom permuted to match
// (graphquant.kernels.mixed_input.operand writes them so).
//
// A programmatic dependent launch: a CTA starts while the kernel before it (x's values' producer, or
// the GEMM before, reading the same x) finishes, and copies what that kernel cannot be writing, a
// stored weight's first steps, before it waits for it; it lets the kernel after it start once it
// has waited.
//
// CUDA only, sm_90a only (wgmma): the CPU emulation of the kernels (tests/emulation) does not build it.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cudaTypedefs.h>

#include <cstdint>
#include <type_traits>

#include "hopper.cuh"
#include "launch.cuh"

namespace gq {
namespace {

using namespace hopper;

constexpr int MXFP8 = 0, NVFP4 = 1;
constexpr int ROWS = 128;     // weight rows a CTA: two warpgroups of 64
constexpr int ATOM = 64;      // K of one 128-byte swizzle atom row of bf16
constexpr int K_MULTIPLE = 128;  // the K mixed_gemm takes: a whole number of steps of either size
constexpr int GEMMS = 3;  // the most GEMMs reading one x a launch runs (graphquant.kernels.mixed_input.SHARED_LAUNCH)

// K a pipeline step: two 64-wide swizzle atoms of x, one for tiles of 256 tokens (whose x, in bf16,
// fills the shared memory four times as fast as the weight's codes).
template <int TOKENS>
constexpr int step_of = TOKENS == 256 ? 64 : 128;
constexpr int PRODUCERS = 128, CONSUMERS = 256, THREADS = PRODUCERS + CONSUMERS;  // a warpgroup copying, two multiplying
constexpr int SMEM_BUDGET = 220 * 1024;  // of the 227 KB an SM's CTAs may have, with the bases' alignment

// Registers a thread of the copying warpgroup and of a multiplying one keeps (setmaxnreg) where an SM
// holds CTAS CTAs: the CTA's share of the 64K register file, 384 threads at launch, moved to the
// consumers. Two CTAs an SM fit where the tile is 16 tokens (its accumulator 8 registers), so that
// one CTA's decoding hides the other's latencies: one CTA an SM leaves 2 warps a scheduler, mostly
// waiting. The K split stays chosen for one CTA an SM: a split's partial sums cost more than the
// second CTA gains (benchmarks/NOTES.md, decode_gemm.py).
template <int CTAS>
struct Registers {
  static constexpr int producer = CTAS == 1 ? 40 : 24;
  static constexpr int consumer = CTAS == 1 ? 232 : 104;
  static_assert(128 * producer + 256 * consumer <= 65536 / CTAS / 384 / 8 * 8 * 384, "setmaxnreg asks for more than launch gives");
};

// Bytes a weight row has per step (codes, block scales), the K one block scale covers, and how its
// scales lie, as each format's representation stores them: MXFP8's block-major, (k / 32, n), a
// stage holding [block][ROWS]; NVFP4's row-major, (n, k / 16), a stage holding [ROWS][16 bytes],
// the 16-byte aligned bytes that hold this step's (TMA copies rows of 16 bytes from 16-byte
// aligned addresses; the rest are other steps', unread).
template <int F, int STEP>
struct Weight {
  static constexpr int code_bytes = F == MXFP8 ? STEP : STEP / 2;
  static constexpr int block = F == MXFP8 ? 32 : 16;
  static constexpr int scale_bytes = STEP / block;
  static constexpr bool row_major_scales = F == NVFP4;
  static constexpr int scale_row = row_major_scales ? 16 : scale_bytes;  // a stage's bytes of scales a weight row
};

template <int F, int TOKENS, int CTAS>
struct Stage {
  static constexpr int step = step_of<TOKENS>;
  static constexpr int x_bytes = TOKENS * step * 2;  // [atoms][TOKENS][64] bf16, 1024-byte aligned atoms
  static constexpr int w_bytes = ROWS * Weight<F, step>::code_bytes;
  static constexpr int s_bytes = ROWS * Weight<F, step>::scale_row;
  static constexpr int bytes = (x_bytes + w_bytes + s_bytes + 1023) / 1024 * 1024;
  static constexpr int budget = SMEM_BUDGET / CTAS;
  static constexpr int count = budget / bytes < 8 ? budget / bytes : 8;
  static constexpr int smem = count * (bytes + 16) + 1024;  // + two barriers a stage, + the base's alignment to 1024
};

// x's values lie with each 64-wide atom permuted (graphquant.kernels.mixed_input.operand): thread t
// of a quad decodes K 16t..16t+15, which the fragment holds at columns 2t, 2t + 1, 2t + 8, 2t + 9 of
// the four k16 slices, a bf16 pair the two values one decoding step makes (e4m3_bits: a word's
// bytes (0 2) and (1 3); e2m1_bits: its nibbles (0 4) ... (3 7)).

template <int TOKENS>
struct Wgmma;

template <>
struct Wgmma<16> {
  __device__ static void mma(float (&d)[8], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1)
        : "memory");
  }
};

template <>
struct Wgmma<32> {
  __device__ static void mma(float (&d)[16], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1)
        : "memory");
  }
};

template <>
struct Wgmma<64> {
  __device__ static void mma(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1)
        : "memory");
  }
};

template <>
struct Wgmma<128> {
  __device__ static void mma(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1)
        : "memory");
  }
};

template <>
struct Wgmma<256> {
  __device__ static void mma(float (&d)[128], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1)
        : "memory");
  }
};

// Two bf16 products, each rounded once.
__device__ __forceinline__ uint32_t bf16_product(uint32_t a, uint32_t b) {
  const __nv_bfloat162 v = __hmul2_rn(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&v);
}

// bf16 pairs 2^-120 times the E4M3 codes B and B + 2 of ``word`` (bytes, the lowest first), 16 bits
// apart as a pair's halves are: each code's exponent and mantissa laid where bf16's lie, so that
// subnormal codes stay exact too.
template <int B>
__device__ __forceinline__ uint32_t e4m3_bits(uint32_t word) {
  constexpr int magnitude = 4 - 8 * B, sign = 8 - 8 * B;  // left shifts to bits 4..10 and 15
  const uint32_t m = magnitude >= 0 ? word << magnitude : word >> -magnitude;
  return (m & 0x07F007F0u) | ((word << sign) & 0x80008000u);
}

// bf16 pairs 2^-126 times the E2M1 codes P and P + 4 of ``word`` (nibbles, the lowest first), 16
// bits apart as a pair's halves are: each code's exponent and mantissa laid where bf16's lie (two
// shifts and two masks a pair), so that the subnormal code stays exact too.
template <int P>
__device__ __forceinline__ uint32_t e2m1_bits(uint32_t word) {
  constexpr int magnitude = 6 - 4 * P, sign = 12 - 4 * P;  // left shifts to bits 6..8 and 15
  const uint32_t m = magnitude >= 0 ? word << magnitude : word >> -magnitude;
  return (m & 0x01C001C0u) | ((word << sign) & 0x80008000u);
}

constexpr uint32_t E4M3_BIAS = 0x7B807B80u;  // 2^120 twice

// NVFP4's decoded weight values are 2^-26 times the format's: an E2M1 pair (2^-126 times the codes)
// times its scale pair times 2^100 in one multiply, not two (E2M1 times E4M3 has at most six
// significant bits, so the product is exact, and 2^-26 keeps it and every sum far from bf16's and
// fp32's ends); the sums are multiplied back by 2^26, exactly, before alpha.
constexpr float NVFP4_SUM_UNIT = 0x1p26f;
template <int F>
constexpr float sum_unit = F == NVFP4 ? NVFP4_SUM_UNIT : 1.f;

// An E8M0 scale as a bf16 pair (2^-127 is bf16's subnormal 0x0040; 255 is NaN).
__device__ __forceinline__ uint32_t e8m0_pair(uint32_t e) {
  const uint32_t bits = e == 0 ? 0x0040u : e == 255 ? 0x7FC0u : e << 7;
  return bits | (bits << 16);
}

// An NVFP4 block's E4M3 scale times 2^100 (2^126 / NVFP4_SUM_UNIT) as a bf16 pair: exact, at most
// 448 * 2^100.
__device__ __forceinline__ uint32_t e4m3_scale_pair(uint8_t code) {
  __nv_fp8_e4m3 scale;
  scale.__x = code;
  const __nv_bfloat16 value = __float2bfloat16_rn(static_cast<float>(scale) * 0x1p100f);
  const uint32_t bits = *reinterpret_cast<const uint16_t*>(&value);
  return bits | (bits << 16);
}

// One GEMM of a launch: what its tiles write. A launch runs one to GEMMS of them, all reading x
// (a layer's q, k and v projections, or its gate and up): their row tiles lie one product after
// another along the grid's y, so one launch's ramp and tail, and one K split, serve them all.
struct Product {
  void* out;
  float* partial;  // (splits, m, n) fp32 where K is split, else null
  const float* w_amax;  // NVFP4's global amax of the weight (alpha's), or null: no alpha
  const void* bias;
  int n, bias_kind;
  int first_tile;  // its first row tile along the grid's y
};

struct Args {
  Product products[GEMMS];
  int gemms;
  int* arrivals;  // where K is split, a counter an output tile, zero (graphquant.kernels.arrival_counters)
  const float* a_amax;  // x's NVFP4 global amax (alpha's), or null
  float divisor;
  int m, k, steps_per_split, out_kind;
  bool stored_weight;  // no kernel of the graph writes the weights: their first steps are copied before the wait
};

// x's tensor map, and each product's weight codes' and block scales' (TMA reads a map where it lies
// in the kernel's parameters).
struct Maps {
  CUtensorMap x, w[GEMMS], s[GEMMS];
};

// The product's factor: (a_amax / divisor) * (w_amax / divisor), each step rounded once, as
// graphquant.formats.nvfp4.global_decode and the emulated GEMM's alpha make it.
__device__ __forceinline__ float alpha_of(const Args& args, const Product& product) {
  return __fmul_rn(__fdiv_rn(*args.a_amax, args.divisor), __fdiv_rn(*product.w_amax, args.divisor));
}

// What store_sums applies, read once a thread: the format's sum unit, alpha, and the bias of each
// of the thread's two rows.
struct Scaling {
  bool has_alpha = false, has_bias = false;
  float unit = 1.f, alpha = 1.f, bias[2] = {0.f, 0.f};
};

// A thread's sums of the wgmma's accumulator (sum 4j + 2h + b: token 8j + 2t + b of the tile, row
// rows[h]), times the unit, then alpha and plus the bias where ``scaling`` has them, into out (m, n)
// row-major.
template <typename Out, int N>
__device__ __forceinline__ void store_sums(const float (&acc)[N], Out* out, int m, int n, int m0, int t, const int (&rows)[2],
                                           const Scaling& scaling) {
#pragma unroll
  for (int j = 0; j < N / 4; ++j) {
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int token = m0 + 8 * j + 2 * t + b;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v = acc[4 * j + 2 * h + b] * scaling.unit;
        v = scaling.has_alpha ? v * scaling.alpha : v;
        v = scaling.has_bias ? v + scaling.bias[h] : v;
        if (token < m && rows[h] < n) store_value(out + static_cast<int64_t>(token) * n + rows[h], v);
      }
    }
  }
}

// Whether this CTA is the last of its output tile's K splits to arrive, each split's partial sums
// stored and fenced before it counts itself (one counter a tile; the last sets it back to zero for
// the next launch on the stream).
__device__ __forceinline__ bool last_to_arrive(const Args& args, int consumer) {
  __shared__ int last;
  __threadfence();
  asm volatile("bar.sync 1, %0;\n" ::"n"(CONSUMERS) : "memory");  // the copying warpgroup has left
  if (consumer == 0) {
    int* counter = args.arrivals + blockIdx.y * gridDim.x + blockIdx.x;
    last = atomicAdd(counter, 1) == static_cast<int>(gridDim.z) - 1;
    if (last) *counter = 0;
  }
  asm volatile("bar.sync 1, %0;\n" ::"n"(CONSUMERS) : "memory");
  if (last) __threadfence();
  return last;
}

// The tile of the last CTA of its K splits to arrive: every split's partial sums added in split
// order (the same bits whichever CTA arrives last), then the sum unit, alpha, the bias and the one rounding;
// read past L1, which holds nothing of the other CTAs' writes. Once a tile, so a plain loop over
// its elements (consecutive threads, consecutive rows of out).
__device__ void finish_split_tile(const Args& args, const Product& product, int m0, int n0, int tokens, float unit, int consumer) {
  const int n = product.n;
  const int64_t plane = static_cast<int64_t>(args.m) * n;
  const float alpha = args.a_amax != nullptr ? alpha_of(args, product) : 1.f;
  for (int i = consumer; i < tokens * ROWS; i += CONSUMERS) {
    const int token = m0 + i / ROWS, row = n0 + i % ROWS;
    if (token >= args.m || row >= n) continue;
    const int64_t index = static_cast<int64_t>(token) * n + row;
    float sum = __ldcg(product.partial + index);
    for (int s = 1; s < static_cast<int>(gridDim.z); ++s) sum += __ldcg(product.partial + s * plane + index);
    float v = sum * unit * alpha;
    if (product.bias != nullptr) v += bias_value(product.bias, product.bias_kind, row);
    if (args.out_kind == BF16) store_value(static_cast<__nv_bfloat16*>(product.out) + index, v);
    else if (args.out_kind == F16) store_value(static_cast<__half*>(product.out) + index, v);
    else store_value(static_cast<float*>(product.out) + index, v);
  }
}

// Warpgroup 0 copies (one thread issuing TMA copies of x's atoms, the weight's codes and its block
// scales into a stage, counted on the stage's ``full`` barrier); warpgroups 1 and 2 multiply, each
// on its own: no CTA barrier in the K loop, so that one's products run while the other decodes and
// moves its operand (each leaves the tensor pipe empty between steps: see the loop), and each marks
// a stage ``empty`` once its wgmmas that read it retired.
template <int F, int TOKENS, int CTAS>
__global__ void __launch_bounds__(THREADS, CTAS) mixed_gemm_kernel(const __grid_constant__ Args args, const __grid_constant__ Maps maps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
  using S = Stage<F, TOKENS, CTAS>;
  constexpr int STEP = S::step, ATOMS = STEP / ATOM, SLICES = STEP / 16;
  using W = Weight<F, STEP>;
  constexpr int STAGES = S::count;
  extern __shared__ uint8_t raw[];
  const uint32_t raw_address = smem_address(raw);
  const uint32_t base = (raw_address + 1023) & ~1023u;
  const uint8_t* base_ptr = raw + (base - raw_address);
  const uint32_t full = base + STAGES * S::bytes, empty = full + 8 * STAGES;  // a barrier a stage each

  const int tid = threadIdx.x;
  int which = 0;  // the product this CTA's row tile is one of
#pragma unroll
  for (int i = 1; i < GEMMS; ++i) which += i < args.gemms && static_cast<int>(blockIdx.y) >= args.products[i].first_tile;
  const Product& product = args.products[which];
  const int n0 = (blockIdx.y - product.first_tile) * ROWS, m0 = blockIdx.x * TOKENS;  // a weight tile's CTAs run together: it is read from memory once
  const int first = blockIdx.z * args.steps_per_split;
  const int count = min(args.steps_per_split, args.k / STEP - first);
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      barrier_init(full + 8 * s, 1);
      barrier_init(empty + 8 * s, CONSUMERS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (tid < PRODUCERS) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Registers<CTAS>::producer) : "memory");
    if (tid == 0) {
      auto load_weight = [&](int j) {  // step j's codes and block scales, and the stage's whole count of bytes
        const uint32_t stage = base + (j % STAGES) * S::bytes, bar = full + 8 * (j % STAGES);
        const int k0 = (first + j) * STEP;
        expect_bytes(bar, S::x_bytes + S::w_bytes + S::s_bytes);
        tma_load(stage + S::x_bytes, maps.w[which], k0 / STEP * W::code_bytes, n0, bar);
        if constexpr (W::row_major_scales) tma_load(stage + S::x_bytes + S::w_bytes, maps.s[which], k0 / W::block / 16 * 16, n0, bar);
        else tma_load(stage + S::x_bytes + S::w_bytes, maps.s[which], n0, k0 / W::block, bar);
      };
      auto load_x = [&](int j) {
        const uint32_t stage = base + (j % STAGES) * S::bytes, bar = full + 8 * (j % STAGES);
#pragma unroll
        for (int a = 0; a < ATOMS; ++a) tma_load(stage + a * (TOKENS * 128), maps.x, (first + j) * STEP + a * ATOM, m0, bar);
      };
      // A dependent launch (launch): a stored weight's first steps are copied while the kernel
      // before this one finishes; x, and everything else, after it. Then the kernel after this one
      // may start (another GEMM, copying its own weight's first steps).
      const int ahead = args.stored_weight ? min(count, STAGES) : 0;
      for (int j = 0; j < ahead; ++j) load_weight(j);
      asm volatile("griddepcontrol.wait;" ::: "memory");
      asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
      for (int j = 0; j < ahead; ++j) load_x(j);
      for (int j = ahead; j < count; ++j) {
        if (j >= STAGES) barrier_wait(empty + 8 * (j % STAGES), (j / STAGES - 1) & 1);
        load_weight(j);
        load_x(j);
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Registers<CTAS>::consumer) : "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");  // before alpha's amax is read or out written

  const int consumer = tid - PRODUCERS;
  const int lane = consumer % 32, warp = (consumer % 128) / 32, warpgroup = consumer / 128;
  const int g = lane / 4, t = lane % 4;
  const int r0 = warpgroup * 64 + warp * 16 + g;  // this thread's weight rows: r0 and r0 + 8

  // The register operand of a step: k16 slice kk's fragment a[kk] (rows r0, r0 + 8 at the columns
  // 2t, 2t + 1, then at 2t + 8, 2t + 9). The stage's codes lie row-major, as the TMA copied them.
  auto decode = [&](int buffer, int step, uint32_t (&a)[SLICES][4]) {
    const uint8_t* codes = base_ptr + buffer * S::bytes + S::x_bytes;
    const uint8_t* scales = codes + S::w_bytes + (W::row_major_scales ? step * W::scale_bytes % 16 : 0);
    if constexpr (F == MXFP8) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r0 + 8 * h;
#pragma unroll
        for (int c = 0; c < ATOMS; ++c) {
          const uint4 q = *reinterpret_cast<const uint4*>(codes + r * W::code_bytes + (c * 4 + t) * 16);
          const uint32_t scale = e8m0_pair(scales[(2 * c + t / 2) * ROWS + r]);
          const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            a[4 * c + s][h] = bf16_product(bf16_product(e4m3_bits<0>(words[s]), E4M3_BIAS), scale);  // columns 2t, 2t + 1
            a[4 * c + s][2 + h] = bf16_product(bf16_product(e4m3_bits<1>(words[s]), E4M3_BIAS), scale);  // 2t + 8, 2t + 9
          }
        }
      }
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r0 + 8 * h;
#pragma unroll
        for (int c = 0; c < ATOMS; ++c) {
          const int unit = c * 4 + t;  // 8 bytes: 16 codes
          const uint2 q = *reinterpret_cast<const uint2*>(codes + r * W::code_bytes + unit * 8);
          const uint32_t scale = e4m3_scale_pair(scales[r * W::scale_row + unit]);
          const uint32_t words[2] = {q.x, q.y};
#pragma unroll
          for (int w = 0; w < 2; ++w) {  // codes p and p + 4 of word w: slice p, columns 2t, 2t + 1 (+ 8 for w = 1)
            a[4 * c + 0][2 * w + h] = bf16_product(e2m1_bits<0>(words[w]), scale);
            a[4 * c + 1][2 * w + h] = bf16_product(e2m1_bits<1>(words[w]), scale);
            a[4 * c + 2][2 * w + h] = bf16_product(e2m1_bits<2>(words[w]), scale);
            a[4 * c + 3][2 * w + h] = bf16_product(e2m1_bits<3>(words[w]), scale);
          }
        }
      }
    }
  };

  float acc[TOKENS / 2];
#pragma unroll
  for (int i = 0; i < TOKENS / 2; ++i) acc[i] = 0.f;

  // Step j's wgmmas run while step j + 1 is decoded into the other register set (ptxas serializes
  // every wgmma where a register feeding one is written while any is in flight); they retire
  // before the stage is given back, and the sets trade roles each step (the loop unrolled twice,
  // so that no step copies its successor's operand into place).
  uint32_t even[SLICES][4], odd[SLICES][4];
  auto step = [&](int j, uint32_t (&operand)[SLICES][4], uint32_t (&successor)[SLICES][4]) {
    const uint32_t x_stage = base + (j % STAGES) * S::bytes;
    uint64_t descriptors[SLICES];
#pragma unroll
    for (int kk = 0; kk < SLICES; ++kk) descriptors[kk] = descriptor(x_stage + (kk / 4) * (TOKENS * 128) + (kk % 4) * 32);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < SLICES; ++kk) Wgmma<TOKENS>::mma(acc, operand[kk], descriptors[kk]);
    wgmma_commit();
    if (j + 1 < count) {
      barrier_wait(full + 8 * ((j + 1) % STAGES), ((j + 1) / STAGES) & 1);
      decode((j + 1) % STAGES, first + j + 1, successor);
    }
    wgmma_wait<0>();
    barrier_arrive(empty + 8 * (j % STAGES));
#pragma unroll
    for (int kk = 0; kk < SLICES; ++kk) keep(operand[kk]);
  };
  barrier_wait(full, 0);
  decode(0, first, even);
#pragma unroll 1
  for (int j = 0; j < count; j += 2) {
    step(j, even, odd);
    if (j + 1 < count) step(j + 1, odd, even);
  }
  keep(acc);

  // The epilogue is unrolled over this thread's sums (registers), so each one's work is a few
  // straight-line instructions: the output's dtype and the bias's are chosen once, outside; a
  // branch an element made the unrolled code far larger than the instruction cache, and the
  // epilogue, not the K loop, took most of the kernel's time.
  const int rows[2] = {n0 + r0, n0 + r0 + 8};
  const int n = product.n;
  if (product.partial != nullptr) {  // K split: the last of the tile's CTAs finishes it, in this launch
    store_sums(acc, product.partial + static_cast<int64_t>(blockIdx.z) * args.m * n, args.m, n, m0, t, rows, Scaling{});
    if (last_to_arrive(args, consumer)) finish_split_tile(args, product, m0, n0, TOKENS, sum_unit<F>, consumer);
    return;
  }
  Scaling scaling;
  scaling.unit = sum_unit<F>;
  scaling.has_alpha = args.a_amax != nullptr;
  scaling.alpha = scaling.has_alpha ? alpha_of(args, product) : 1.f;
  scaling.has_bias = product.bias != nullptr;
#pragma unroll
  for (int h = 0; h < 2; ++h) scaling.bias[h] = scaling.has_bias && rows[h] < n ? bias_value(product.bias, product.bias_kind, rows[h]) : 0.f;
  if (args.out_kind == BF16) store_sums(acc, static_cast<__nv_bfloat16*>(product.out), args.m, n, m0, t, rows, scaling);
  else if (args.out_kind == F16) store_sums(acc, static_cast<__half*>(product.out), args.m, n, m0, t, rows, scaling);
  else store_sums(acc, static_cast<float*>(product.out), args.m, n, m0, t, rows, scaling);
#endif
}

}  // namespace

const char* format_name(int64_t format) { return format == MXFP8 ? "MXFP8" : "NVFP4"; }

void check_device(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_cuda(), "graphquant.mixed_gemm: ", what, " must be a CUDA tensor");
  const auto* properties = at::cuda::getDeviceProperties(t.get_device());
  TORCH_CHECK(properties->major == 9 && properties->minor == 0,
              "graphquant.mixed_gemm runs on sm_90 (Hopper's wgmma) alone, not on sm_", properties->major, properties->minor);
}

// Codes of an operand (rows, k) as the kernels read them: rows of whole 16-byte groups, k a
// multiple of the step.
void check_codes(const at::Tensor& codes, int64_t format, int64_t k, const char* name) {
  const int64_t code_bytes = format == MXFP8 ? k : k / 2;
  TORCH_CHECK(format == MXFP8 || format == NVFP4, "graphquant.mixed_gemm: format ", format, " is neither MXFP8 (0) nor NVFP4 (1)");
  TORCH_CHECK(k % K_MULTIPLE == 0, "graphquant.mixed_gemm multiplies a reduction of a multiple of ", K_MULTIPLE, " values, got k = ", k);
  TORCH_CHECK(codes.dim() == 2 && codes.element_size() == 1 && codes.size(1) == code_bytes && codes.stride(1) == 1 &&
                  codes.stride(0) % 16 == 0 && reinterpret_cast<uintptr_t>(codes.data_ptr()) % 16 == 0,
              "graphquant.mixed_gemm: ", name, "'s ", format_name(format), " codes must be (rows, ", code_bytes,
              ") bytes with rows 16-byte aligned, got ", codes.scalar_type(), " ", codes.sizes(), " strides ", codes.strides());
}

int64_t scale_blocks(int64_t format, int64_t k) { return format == MXFP8 ? k / 32 : k / 16; }

// A weight of the launch as its tensor maps read it: codes (n, k or k / 2 bytes) and block scales.
struct WeightBytes {
  const void *codes, *scales;
  int64_t n, stride, scale_stride;  // rows, and each operand's bytes a row
};

template <int F, int TOKENS, int CTAS>
void launch(const Args& args, const at::Tensor& x, const std::vector<WeightBytes>& weights, dim3 grid, cudaStream_t stream) {
  using S = Stage<F, TOKENS, CTAS>;
  using W = Weight<F, S::step>;
  const char* what = "graphquant.mixed_gemm";
  opt_in_shared_memory(reinterpret_cast<const void*>(mixed_gemm_kernel<F, TOKENS, CTAS>), S::smem, what);
  Maps maps = {};
  maps.x = tensor_map(what, x.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, args.m, args.k, x.stride(0) * 2, TOKENS, ATOM, CU_TENSOR_MAP_SWIZZLE_128B);
  const int64_t blocks = args.k / W::block;
  for (size_t i = 0; i < weights.size(); ++i) {
    const WeightBytes& w = weights[i];
    if (w.n == 0) continue;  // no tile reads it (a map cannot describe no rows)
    maps.w[i] = tensor_map(what, w.codes, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, w.n, F == MXFP8 ? args.k : args.k / 2, w.stride, ROWS, W::code_bytes,
                           CU_TENSOR_MAP_SWIZZLE_NONE);
    maps.s[i] = W::row_major_scales
                    ? tensor_map(what, w.scales, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, w.n, blocks, w.scale_stride, ROWS, W::scale_row, CU_TENSOR_MAP_SWIZZLE_NONE)
                    : tensor_map(what, w.scales, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, blocks, w.n, w.scale_stride, W::scale_row, ROWS, CU_TENSOR_MAP_SWIZZLE_NONE);
  }
  // A programmatic dependent launch: it starts while the kernel before it finishes (the kernel
  // waits for it before it reads what that kernel writes).
  cudaLaunchAttribute dependent;
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = dependent_launch() ? 1 : 0;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(THREADS);
  config.dynamicSmemBytes = S::smem;
  config.stream = stream;
  config.attrs = &dependent;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, mixed_gemm_kernel<F, TOKENS, CTAS>, args, maps);
  check_launch("mixed_gemm");
}

template <int F>
void launch_tokens(int64_t tokens, const Args& args, const at::Tensor& x, const std::vector<WeightBytes>& weights, dim3 grid, cudaStream_t stream) {
  switch (tokens) {
    case 16: return launch<F, 16, 2>(args, x, weights, grid, stream);  // two CTAs an SM (Registers); 32 tokens spill at 104 registers
    case 32: return launch<F, 32, 1>(args, x, weights, grid, stream);
    case 64: return launch<F, 64, 1>(args, x, weights, grid, stream);
    case 128: return launch<F, 128, 1>(args, x, weights, grid, stream);
    default: return launch<F, 256, 1>(args, x, weights, grid, stream);
  }
}

// Weight ``i`` of a launch (codes, scales, NVFP4's amax, bias) as the kernel reads it, ``n`` rows of
// ``k``.
void check_weight(const at::Tensor& w, const at::Tensor& w_scale, int64_t format, int64_t k, const std::optional<at::Tensor>& w_amax,
                  const std::optional<at::Tensor>& bias, const at::Tensor& x, size_t i) {
  const std::string name = "weight " + std::to_string(i);
  check_codes(w, format, k, name.c_str());
  const int64_t n = w.size(0);
  const bool row_major_scales = format == NVFP4;  // Weight::row_major_scales
  const int64_t scale_rows = row_major_scales ? n : scale_blocks(format, k), scale_cols = row_major_scales ? scale_blocks(format, k) : n;
  TORCH_CHECK(w_scale.dim() == 2 && w_scale.element_size() == 1 && w_scale.size(0) == scale_rows && w_scale.size(1) == scale_cols &&
                  w_scale.stride(1) == 1 && w_scale.stride(0) % 16 == 0 && reinterpret_cast<uintptr_t>(w_scale.data_ptr()) % 16 == 0 &&
                  w_scale.device() == x.device(),
              "graphquant.mixed_gemm: ", name, "'s ", format_name(format), " scales must lie ", row_major_scales ? "row-major" : "block-major", ", (",
              scale_rows, ", ", scale_cols, ") bytes with rows 16-byte aligned on x's device, got ", w_scale.scalar_type(), " ", w_scale.sizes(),
              " strides ", w_scale.strides());
  TORCH_CHECK(w.device() == x.device() && w.numel() < (int64_t{1} << 31),
              "graphquant.mixed_gemm: ", name, " must lie on x's device and have fewer than 2^31 elements, got ", w.sizes(), " on ", w.device());
  TORCH_CHECK(!w_amax || ((w_amax->scalar_type() == at::kFloat && w_amax->numel() == 1 && w_amax->device() == x.device())),
              "graphquant.mixed_gemm: ", name, "'s amax must be one float32 on x's device");
  TORCH_CHECK(!bias || ((bias->scalar_type() == at::kBFloat16 || bias->scalar_type() == at::kHalf) && bias->numel() == n &&
                        bias->is_contiguous() && bias->device() == x.device()),
              "graphquant.mixed_gemm: ", name, "'s bias must be ", n, " contiguous bfloat16 or float16 values on x's device");
}

std::vector<at::Tensor> mixed_gemm(const at::Tensor& x, const std::vector<at::Tensor>& ws, const std::vector<at::Tensor>& w_scales, int64_t format,
                                   const std::optional<at::Tensor>& a_amax, const std::vector<std::optional<at::Tensor>>& w_amaxes, double divisor,
                                   const std::vector<std::optional<at::Tensor>>& biases, at::ScalarType out_dtype, int64_t tokens, int64_t splits,
                                   const at::Tensor& arrivals, bool stored_weight) {
  const size_t gemms = ws.size();
  TORCH_CHECK(gemms >= 1 && gemms <= GEMMS && w_scales.size() == gemms && w_amaxes.size() == gemms && biases.size() == gemms,
              "graphquant.mixed_gemm runs 1 to ", GEMMS, " weights that read one x a launch, each with its scales, amax (or None) and bias (or None); got ",
              gemms, " weights, ", w_scales.size(), " scales, ", w_amaxes.size(), " amaxes and ", biases.size(), " biases");
  check_device(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && x.stride(0) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && x.numel() < (int64_t{1} << 31),
              "graphquant.mixed_gemm: x must be bf16 values (m, k) of fewer than 2^31 elements, rows 16-byte aligned, got ", x.scalar_type(), " ",
              x.sizes(), " strides ", x.strides());
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kHalf || out_dtype == at::kFloat,
              "graphquant.mixed_gemm writes bfloat16, float16 or float32, not ", out_dtype);
  TORCH_CHECK(!a_amax || (a_amax->scalar_type() == at::kFloat && a_amax->numel() == 1 && a_amax->device() == x.device()),
              "graphquant.mixed_gemm: x's amax must be one float32 on x's device");
  TORCH_CHECK(tokens == 16 || tokens == 32 || tokens == 64 || tokens == 128 || tokens == 256,
              "graphquant.mixed_gemm multiplies tiles of 16, 32, 64, 128 or 256 rows of x, not ", tokens);
  for (size_t i = 0; i < gemms; ++i) {
    check_weight(ws[i], w_scales[i], format, k, w_amaxes[i], biases[i], x, i);
    TORCH_CHECK(w_amaxes[i].has_value() == a_amax.has_value(), "graphquant.mixed_gemm takes x's and every weight's amax, or none");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  std::vector<at::Tensor> outs;
  int64_t row_tiles = 0;
  for (const auto& w : ws) {
    outs.push_back(at::empty({m, w.size(0)}, x.options().dtype(out_dtype)));
    row_tiles += (w.size(0) + ROWS - 1) / ROWS;
  }
  if (m == 0 || row_tiles == 0) return outs;
  const int64_t steps = k / (tokens == 256 ? step_of<256> : step_of<128>);
  const int64_t token_tiles = (m + tokens - 1) / tokens;
  const int sms = at::cuda::getDeviceProperties(x.get_device())->multiProcessorCount;
  const KSplit split = k_split(splits, row_tiles * token_tiles, steps, sms, 4);
  splits = split.splits;
  at::Tensor partial;
  if (splits > 1) {
    int64_t columns = 0;
    for (const auto& out : outs) columns += out.size(1);
    partial = at::empty({splits * m * columns}, x.options().dtype(at::kFloat));
    TORCH_CHECK(arrivals.scalar_type() == at::kInt && arrivals.device() == x.device() && arrivals.is_contiguous() &&
                    arrivals.numel() >= row_tiles * token_tiles,
                "graphquant.mixed_gemm: a K split of ", row_tiles * token_tiles, " output tiles takes as many zero int32 arrival counters "
                "on x's device (graphquant.kernels.arrival_counters), got ", arrivals.scalar_type(), " ", arrivals.sizes());
  }
  Args args = {};
  std::vector<WeightBytes> weights;
  int first_tile = 0;
  int64_t partial_offset = 0;
  for (size_t i = 0; i < gemms; ++i) {
    const int64_t n = ws[i].size(0);
    Product& product = args.products[i];
    product.out = outs[i].data_ptr();
    product.partial = splits > 1 ? partial.data_ptr<float>() + partial_offset : nullptr;
    product.w_amax = w_amaxes[i] ? w_amaxes[i]->data_ptr<float>() : nullptr;
    product.bias = biases[i] ? biases[i]->data_ptr() : nullptr;
    product.n = static_cast<int>(n);
    product.bias_kind = biases[i] ? kind(biases[i]->scalar_type()) : BF16;
    product.first_tile = first_tile;
    first_tile += static_cast<int>((n + ROWS - 1) / ROWS);
    partial_offset += splits * m * n;
    weights.push_back({ws[i].data_ptr(), w_scales[i].data_ptr(), n, ws[i].stride(0), w_scales[i].stride(0)});
  }
  args.gemms = static_cast<int>(gemms);
  args.arrivals = splits > 1 ? arrivals.data_ptr<int>() : nullptr;
  args.a_amax = a_amax ? a_amax->data_ptr<float>() : nullptr;
  args.divisor = static_cast<float>(divisor);
  args.m = static_cast<int>(m);
  args.k = static_cast<int>(k);
  args.steps_per_split = static_cast<int>(split.steps_per_split);
  args.out_kind = kind(out_dtype);
  args.stored_weight = stored_weight;
  const dim3 grid(static_cast<unsigned>(token_tiles), static_cast<unsigned>(row_tiles), static_cast<unsigned>(splits));
  auto stream = at::cuda::getCurrentCUDAStream();
  format == MXFP8 ? launch_tokens<MXFP8>(tokens, args, x, weights, grid, stream) : launch_tokens<NVFP4>(tokens, args, x, weights, grid, stream);
  return outs;
}

}  // namespace gq

void register_mixed_gemm(pybind11::module_& m) {
  m.def("mixed_gemm", &gq::mixed_gemm,
        "[out_i (m, n_i) = alpha_i * (x @ w_i^T) + bias_i] for 1 to 3 weights that read one x, in one launch: x's bf16 values (m, k), each 64-wide atom permuted "
        "as the kernel reads it (graphquant.kernels.mixed_input.operand), and MXFP8 (format 0) or NVFP4 (1) weights w_i (n_i, k) (codes; block scales as the "
        "formats store them: MXFP8's block-major, (k / 32, n), NVFP4's row-major, (n, k / 16)) decoded in registers on sm_90's bf16 tensor cores: fp32 sums "
        "(a K split's added in order), alpha_i = (a_amax / divisor) * (w_amax_i / divisor) (NVFP4's global factors: one float32 each, or None) and bias_i "
        "(n_i bf16 or float16, or None) before one rounding to out_dtype; tokens: the rows of x a CTA multiplies (16, 32, 64, 128 or 256); splits: K's "
        "split (0: chosen for the SMs and all the weights' row tiles), the last CTA of an output tile adding its splits' sums in order; arrivals: zero "
        "int32 counters, one an output tile (128 rows of a weight by tokens rows of x), which a split launch leaves zero; stored_weight: no kernel "
        "writes the weights and their scales (a frozen model's), so their first steps are copied while the kernel before finishes",
        pybind11::arg("x"), pybind11::arg("ws"), pybind11::arg("w_scales"), pybind11::arg("format"), pybind11::arg("a_amax"), pybind11::arg("w_amaxes"),
        pybind11::arg("divisor"), pybind11::arg("biases"), pybind11::arg("out_dtype"), pybind11::arg("tokens"), pybind11::arg("splits"),
        pybind11::arg("arrivals"), pybind11::arg("stored_weight"));
}
