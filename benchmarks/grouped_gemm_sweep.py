"""Launch configurations of the Triton FP8 grouped GEMM (graphquant.kernels.triton_grouped_fp8)
at an MoE step's shapes: its dgrad and wgrad kernels under many tiles, warp counts, pipeline
depths, tile orders and register caps, beside the same GEMMs on torch._scaled_grouped_mm (its
tensor cores' sums not promoted) and on bf16 torch._grouped_mm.

    python benchmarks/grouped_gemm_sweep.py [--formats rowwise,deepseek_blockwise] [--sites gate_up,down] [--sums promoted] [--jobs 5] [--reps 5]

The shapes are grouped_gemm.py's. ``--sums``: the kernel's sums as the plan runs them where a
recipe keeps fp32 sums (promoted) or lets the GEMM accumulate fast (fast; block scales promote
either way). Every configuration's output is compared bit for bit with the first one's: the
kernel sums in the same order whatever the tile, so any difference is a defect. The
configurations are compiled first in ``--jobs`` processes at once (Triton's cache on disk carries
them over), then timed here one after another. Each row is
printed as soon as it is measured: a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import NamedTuple, Optional

import torch
import triton

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import time_ms  # noqa: E402
from grouped_gemm import EXPERTS, SITES, TOKENS, TOP_K, operands, routed  # noqa: E402

from graphquant.formats import groups  # noqa: E402
from graphquant.kernels import backends  # noqa: E402
from graphquant.kernels import grouped as grouped_kernels  # noqa: E402

GEMMS = ("dgrad", "wgrad")


class Variant(NamedTuple):
    """One launch configuration of both kernels."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    group_tiles: int = 8
    maxnreg: Optional[int] = None
    byte_codes: bool = False  # the operands handed over as bytes, cast to FP8 in the kernel

    def __str__(self) -> str:
        cap = f" maxnreg {self.maxnreg}" if self.maxnreg else ""
        codes = " bytes" if self.byte_codes else ""
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.warps} s{self.stages} g{self.group_tiles}{cap}{codes}"

    def fits(self, gemm: str, block_scaled: bool) -> bool:
        """Whether the kernel of ``gemm`` can run this tile: a K tile of one block scale where the
        scales are per block; dgrad's row tiles within one 128-row group; wgrad's K tiles within
        one group (its groups are multiples of 128 rows and it masks no K)."""
        if block_scaled and self.block_k != 128:
            return False
        return 128 % self.block_m == 0 if gemm == "dgrad" else 128 % self.block_k == 0


# The first is the kernel as it was before this sweep (operands as bytes). Triton's promoted sums wait for each
# 32-long wgmma before adding it: warp groups resident per SM are what hide those waits, so
# smaller tiles, K tiles of 32 (one wgmma: no registers for several partial sums) and fewer
# registers (more CTAs an SM). Block scales need K tiles of 128.
VARIANTS = [
    Variant(128, 128, 128, 8, 3, byte_codes=True),
    Variant(64, 128, 32, 4, 6, byte_codes=True),
    Variant(128, 128, 128, 8, 3),
    Variant(128, 128, 128, 8, 4),
    Variant(64, 128, 128, 4, 3),
    Variant(128, 64, 128, 4, 3),
    Variant(64, 64, 128, 4, 3),
    Variant(64, 64, 128, 4, 4),
    Variant(128, 64, 128, 8, 4),
    Variant(64, 256, 128, 8, 3),
    Variant(128, 128, 128, 4, 3),
    Variant(128, 128, 64, 8, 4),
    Variant(64, 128, 64, 4, 4),
    Variant(64, 64, 64, 4, 4),
    Variant(128, 128, 32, 8, 4),
    Variant(128, 128, 32, 8, 6),
    Variant(128, 128, 32, 8, 8),
    Variant(64, 128, 32, 4, 4),
    Variant(64, 128, 32, 4, 6),
    Variant(64, 128, 32, 4, 8),
    Variant(64, 64, 32, 4, 4),
    Variant(64, 64, 32, 4, 6),
    Variant(64, 64, 32, 4, 8),
    Variant(128, 64, 32, 4, 6),
    Variant(64, 256, 32, 8, 4),
    Variant(64, 256, 32, 8, 6),
    Variant(256, 128, 32, 8, 4),
    Variant(64, 128, 32, 4, 6, group_tiles=4),
    Variant(64, 128, 32, 4, 6, group_tiles=16),
    Variant(128, 128, 32, 8, 6, group_tiles=4),
    Variant(128, 128, 32, 8, 6, group_tiles=16),
    Variant(64, 64, 32, 4, 6, group_tiles=16),
    Variant(64, 128, 32, 4, 6, maxnreg=128),
]


def _jit(kernel):
    """The JITFunction under a kernel's autotune and heuristics wrappers."""
    while not isinstance(kernel, triton.runtime.JITFunction):
        kernel = kernel.fn
    return kernel


KERNELS = backends.triton_grouped_fp8
SCALED_GROUPED_MM = backends.GemmBackend(backends.SCALED_GROUPED_MM, fast_accumulation=True)
FP8_CODES = KERNELS.operands.codes
COMPILED = {}  # kernel name -> the CompiledKernel its last launch ran


def _recording(kernel):
    jit = _jit(kernel)
    run = jit.run

    def recorded(*args, **kwargs):
        compiled = run(*args, **kwargs)
        COMPILED[jit.__name__] = compiled
        return compiled

    jit.run = recorded


_recording(KERNELS._tokens_by_experts)
_recording(KERNELS._tokens_by_tokens)


def select(variant: Variant) -> None:
    """Make ``variant`` the only configuration both kernels' autotuners know."""
    config = triton.Config(
        {"BLOCK_M": variant.block_m, "BLOCK_N": variant.block_n, "BLOCK_K": variant.block_k},
        num_warps=variant.warps, num_stages=variant.stages, maxnreg=variant.maxnreg,
    )
    for kernel in (KERNELS._tokens_by_experts, KERNELS._tokens_by_tokens):
        kernel.configs = [config]
        kernel.early_config_prune = None  # which would offer the kernel's own tiles of the call's kind
        kernel.cache = {}
    KERNELS.GROUP_TILES = variant.group_tiles
    KERNELS.operands.codes = (lambda rep: rep.data.view(torch.uint8)) if variant.byte_codes else FP8_CODES


def cases(formats: list[str], sites: list[str], fast: bool):
    """(format, site, {GEMM: (a call of it on the Triton kernel as the plan runs it, ``fast`` or
    not, a call on a given backend, torch._scaled_grouped_mm's backend where it takes the GEMM or
    None, whether block-scaled)}, (bf16 x, w, dy, offs)) for every format and site, built one at
    a time."""
    offs, tokens = routed()
    rows = TOKENS * TOP_K
    for site in sites:
        k, n = SITES[site]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(EXPERTS, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        for name in formats:
            calls = {}
            for gemm, (a, b, b_group, width) in operands(name, x, w, dy, tokens).items():
                def call(backend, a=a, b=b, b_group=b_group, width=width, gemm=gemm):
                    return grouped_kernels.gemm(a, b, b_group, tokens, groups.GROUP_ROWS, width, torch.bfloat16, backend, f"{site} {gemm}")

                inputs = (a.quantizer.gemm_input(a.direction), b.quantizer.gemm_input(b.direction))
                # The Triton kernel as the plan runs it where graphquant's CUDA grouped GEMM is not
                # built (which the plan takes first for groups of whole tiles).
                triton_kernel = backends.NATIVE_BY_NAME[KERNELS.BACKEND]
                assert triton_kernel.takes(*inputs), (name, gemm)
                planned = backends.GemmBackend(KERNELS.BACKEND, triton_kernel.accumulates_fast(*inputs, fast))
                scaled = SCALED_GROUPED_MM if backends.NATIVE_GROUPED_GEMM.takes(*inputs) else None
                calls[gemm] = (functools.partial(call, planned), call, scaled, KERNELS.operands.block_scaled(a))
            yield name, site, calls, (x, w, dy, offs)
        del x, w, dy


def _compile(job: tuple[list[int], list[str], list[str], bool, bool]) -> dict:
    """Run every variant in ``indices`` once on every case (compiling it into Triton's cache);
    {(variant index, format, site, GEMM): the error} of those that fail. ``say``: print each
    first run as it starts (in one process: a run that hangs is named)."""
    indices, formats, sites, fast, say = job
    failed = {}
    for name, site, calls, _ in cases(formats, sites, fast):
        for index in indices:
            variant = VARIANTS[index]
            select(variant)
            for gemm in GEMMS:
                call, _, _, block_scaled = calls[gemm]
                if not variant.fits(gemm, block_scaled):
                    continue
                if say:
                    print(f"first run: [{index}] {variant}, {name} {site} {gemm}", flush=True)
                try:
                    call()
                    torch.cuda.synchronize()
                except Exception as error:  # noqa: BLE001 (a variant may not fit the SM: say so and go on)
                    failed[(index, name, site, gemm)] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    return failed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--formats", default="rowwise,deepseek_blockwise")
    parser.add_argument("--sites", default="gate_up,down")
    parser.add_argument("--variants", default="", help="comma-separated indices into VARIANTS (default: all)")
    parser.add_argument("--jobs", type=int, default=5, help="compiling processes (each holds its own operands: 8-20 GB without the CUDA extension)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sums", choices=("promoted", "fast"), default="promoted", help="the kernel's sums: promoted into fp32, or fast accumulation")
    args = parser.parse_args()
    fast = args.sums == "fast"
    formats, sites = args.formats.split(","), args.sites.split(",")
    chosen = [int(i) for i in args.variants.split(",")] if args.variants else list(range(len(VARIANTS)))
    began = time.time()
    jobs = [(chosen[i :: args.jobs], formats, sites, fast, args.jobs == 1) for i in range(min(args.jobs, len(chosen)))]
    failed = {}
    if len(jobs) > 1:
        try:
            with ProcessPoolExecutor(len(jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
                failed = {key: error for part in pool.map(_compile, jobs) for key, error in part.items()}
        except BrokenProcessPool as error:  # a variant crashed its process: the rest compile as they run below
            print(f"parallel compilation stopped: {error}", flush=True)
    else:
        failed = _compile(jobs[0])
    print(f"compiled {len(chosen)} variants in {len(jobs)} processes: {time.time() - began:.0f} s", flush=True)
    rows = TOKENS * TOP_K
    print("format | site | GEMM | backend or variant | ms | TFLOP/s | vs torch._scaled_grouped_mm | regs | spills | smem KiB | same bits", flush=True)
    for name, site, calls, (x, w, dy, offs) in cases(formats, sites, fast):
        k, n = SITES[site]
        flops = 2.0 * rows * k * n
        bf16 = {"dgrad": lambda: torch._grouped_mm(dy, w, offs=offs), "wgrad": lambda: torch._grouped_mm(dy.t(), x, offs=offs)}
        for gemm in GEMMS:
            call, on, scaled, block_scaled = calls[gemm]
            reference_ms = None
            if gemm in bf16 and name == formats[0]:
                ms = time_ms(bf16[gemm], warmup=2, reps=args.reps)
                print(f"{name} | {site} | {gemm} | bf16 torch._grouped_mm | {ms:.3f} | {flops / ms / 1e9:.0f} | | | | |", flush=True)
            if scaled is not None:
                reference_ms = time_ms(lambda: on(scaled), warmup=2, reps=args.reps)
                print(f"{name} | {site} | {gemm} | {scaled} | {reference_ms:.3f} | {flops / reference_ms / 1e9:.0f} | 1.00x | | | |", flush=True)
            first = None
            for index in chosen:
                variant = VARIANTS[index]
                if not variant.fits(gemm, block_scaled):
                    continue
                label = f"{name} | {site} | {gemm} | [{index}] {variant}"
                if (index, name, site, gemm) in failed:
                    print(f"{label} | failed: {failed[(index, name, site, gemm)]}", flush=True)
                    continue
                select(variant)
                out = call()
                first = out if first is None else first
                same = "yes" if torch.equal(out, first) else "NO"
                del out
                compiled = COMPILED[_jit(KERNELS._tokens_by_experts if gemm == "dgrad" else KERNELS._tokens_by_tokens).__name__]
                ms = time_ms(call, warmup=2, reps=args.reps)
                against = f"{reference_ms / ms:.2f}x" if reference_ms else ""
                print(
                    f"{label} | {ms:.3f} | {flops / ms / 1e9:.0f} | {against} | {compiled.n_regs} | {compiled.n_spills} | "
                    f"{compiled.metadata.shared / 1024:.0f} | {same}",
                    flush=True,
                )
    print(f"done in {time.time() - began:.0f} s", flush=True)


if __name__ == "__main__":
    main()
