"""2^x on the FMA pipe, for kernels whose exponentials would otherwise queue on the special-function
unit (16 ex2 a cycle an SM on Hopper against 128 FMAs).

x is rounded to the nearest integer j by adding and subtracting 1.5 * 2^23 (the sum keeps j in its
low mantissa bits), f = x - j in [-1/2, 1/2] is exact, 2^f is a degree-6 polynomial, and j is
added to its exponent field as an integer. The polynomial's coefficients are the float32 roundings
of the minimax fit of 2^f's relative error on [-1/2, 1/2] with its constant term 1, so f = 0 gives
1 exactly.

Error, as tests/test_triton_exp2.py checks against float64 for every float32 exponent (Horner's
steps fused or not): relative at most 2^-23 where 2^x is a normal float32 (x >= -126; ex2.approx.f32
allows about 2^-22); below that at most 2^-126 absolute, and exactly 0 from x = -127 down, -inf
included (as ex2.approx.ftz flushes). x must be below 128 (2^x overflows there); NaN and +inf are
outside its domain.
"""

import triton
import triton.language as tl

# 1.5 * 2^23: adding it to |x| < 2^22 rounds x to an integer held in the low bits of the mantissa.
ROUNDER = tl.constexpr(12582912.0)


@triton.jit
def exp2_fma(x):
    """2^x by FMAs and integer adds, no special-function unit (module docstring: the bound)."""
    x = tl.maximum(x, -127.0)
    shifted = x + ROUNDER
    f = x - (shifted - ROUNDER)
    p = 1.5018017438706011e-04
    p = p * f + 1.3372311368584633e-03
    p = p * f + 9.6192052587866783e-03
    p = p * f + 5.5504083633422852e-02
    p = p * f + 2.4022650718688965e-01
    p = p * f + 6.9314718246459961e-01
    p = p * f + 1.0
    exponent = shifted.to(tl.int32, bitcast=True) << 23  # j in the exponent field (the rounder's bits shift out)
    return (p.to(tl.int32, bitcast=True) + exponent).to(tl.float32, bitcast=True)


@triton.jit
def exp2_halves(x):
    """2^x of a 2-D tile, the even columns on the special-function unit (tl.math.exp2) and the
    odd ones by ``exp2_fma``: a thread of a tensor-core accumulator holds columns in adjacent
    pairs, so the split and the join move no data."""
    rows: tl.constexpr = x.shape[0]
    cols: tl.constexpr = x.shape[1]
    even, odd = tl.split(tl.reshape(x, [rows, cols // 2, 2]))
    return tl.reshape(tl.join(tl.math.exp2(even), exp2_fma(odd)), [rows, cols])
