"""How many FP8 products a GEMM sums in the tensor cores' accumulator before fp32 takes the sum,
and how many bits below the largest term that accumulator keeps, read off its results
(graphquant.formats.fp8's accumulation model takes both numbers from here).

    python benchmarks/accumulation_probe.py [--k 1024]

One output is the sum of a large product (256) and K - 1 small ones (2^-8 each), the large one
first. Hopper's FP8 tensor cores align the terms of a chain of MMAs to its largest one, keeping
about 14 bits: next to 256 every small product is lost, while a chain with only small products
sums them exactly. So the result is 256 + (K - P) 2^-8, where P is the number of products summed
in the accumulator with the large one: the promotion interval (P = K: never promoted, fast
accumulation). Printed for cuBLASLt through torch._scaled_mm with and without fast accumulation,
and for Triton's tl.dot with each ``max_num_imprecise_acc`` (the calibration: it must read P back).

Then, in one promotion step (K = 128), the large product and 127 small ones of 2^-j times it:
the share of their sum the result keeps is 1 while a small product lies within the bits the
accumulator keeps below the large one's leading bit and 0 (each one dropped whole, not the sum
of them rounded) past them, so the largest j kept whole is those bits
(fp8.ACCUMULATOR_FRACTION_BITS).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from tabulate import tabulate

LARGE, SMALL = 256.0, 2.0**-8
ROWS = 64  # a tile of Hopper's warp-group MMA (wgmma), which Triton then uses
STEP = 128  # products in one promotion step of both GEMMs promoted below
BELOW = range(10, 17)  # the small product 2^-j of the large one, each j


def operands(k: int, small: float = SMALL) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) in E4M3, (ROWS, k) and (ROWS, k), whose every product's row sum is one large term then small ones."""
    a = torch.ones(ROWS, k, device="cuda")
    b = torch.full((ROWS, k), small, device="cuda")
    b[:, 0] = LARGE
    return a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)


def products_with_the_large_one(total: float, k: int) -> float:
    """P, from a result 256 + (K - P) 2^-8."""
    return k - (total - LARGE) / SMALL


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, K: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, IMPRECISE: tl.constexpr):
    rows = tl.arange(0, ROWS)
    acc = tl.zeros((ROWS, ROWS), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * K + cols[None, :])
        b = tl.load(b_ptr + rows[:, None] * K + cols[None, :])
        acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=IMPRECISE)
    tl.store(out_ptr + rows[:, None] * ROWS + rows[None, :], acc)


def triton_dot(a: torch.Tensor, b: torch.Tensor, imprecise: int | None) -> float:
    out = torch.empty(ROWS, ROWS, device="cuda")
    _dot_kernel[(1,)](a, b, out, K=a.shape[1], ROWS=ROWS, BLOCK_K=128, IMPRECISE=imprecise)
    return out[0, 0].item()


def scaled_mm(a: torch.Tensor, b: torch.Tensor, fast: bool) -> float:
    one = torch.ones((), device="cuda")
    return torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast)[0, 0].item()


def kept_share(gemm, j: int) -> float:
    """The share of the small products' sum that ``gemm`` keeps in a step with a large product
    2^j times each."""
    small = LARGE * 2.0**-j
    return (gemm(*operands(STEP, small)) - LARGE) / ((STEP - 1) * small)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=1024)
    k = parser.parse_args().k
    a, b = operands(k)
    rows = [(f"triton tl.dot, max_num_imprecise_acc={p}", triton_dot(a, b, p)) for p in (32, 64, 128)]
    rows.append(("triton tl.dot, max_num_imprecise_acc unset (its FP8 default on sm_90)", triton_dot(a, b, None)))
    rows += [(f"cuBLASLt torch._scaled_mm, use_fast_accum={fast}", scaled_mm(a, b, fast)) for fast in (False, True)]
    print(f"K = {k}: one product of {LARGE:g}, then {k - 1} of 2^-8 (exact sum {LARGE + (k - 1) * SMALL:g})")
    print(tabulate([(name, f"{total:.6f}", f"{products_with_the_large_one(total, k):g}") for name, total in rows],
                   headers=["GEMM", "result", "products summed with the large one (P)"], disable_numparse=True))
    gemms = {f"triton tl.dot, max_num_imprecise_acc={STEP}": lambda a, b: triton_dot(a, b, STEP),
             "cuBLASLt torch._scaled_mm, use_fast_accum=False": lambda a, b: scaled_mm(a, b, False)}
    print(f"\nK = {STEP}: one product of {LARGE:g}, then {STEP - 1} of 2^-j times it; the share of their sum kept")
    print(tabulate([(name, *(f"{kept_share(gemm, j):g}" for j in BELOW)) for name, gemm in gemms.items()],
                   headers=["GEMM", *(f"j = {j}" for j in BELOW)], disable_numparse=True))


if __name__ == "__main__":
    main()
