"""Microseconds and weight GB/s of the decode GEMM beside bf16 F.linear, torch._scaled_mm and,
for MXFP8 and NVFP4, the emulated GEMM (the weight dequantized on every call, then bf16).

    python benchmarks/decode_gemm.py [--rows 1,16,128,2048] [--formats "fp8 tensorwise,nvfp4"] [--weights 14336x4096,28672x4096] [--pairs] [--copies N]

For each weight N x K of a Llama-3-8B FFN (or of --weights: 28672x4096 is its gate and up
projections as one weight) and each row count M (each format up to the decode
GEMM's rows for it: triton_decode.MAX_ROWS, FP8 16, MXFP8 and NVFP4 128; past them the
GEMM the plan picks, fast accumulation allowed, as "plan"; MXFP8 and NVFP4 also on the mixed-input
wgmma GEMM, graphquant.kernels.mixed_input, where the extension runs), every row is measured in the same
run, alternating over rounds, on operands quantized beforehand (the activation's quantize is not
timed, nor the mixed-input GEMM's bf16 values of it, which a graph makes by an op of their own), and
for the FP8 formats the GEMM that quantizes the bf16 activation itself
(triton_decode.QuantizedOnLoad, its amaxes taken beforehand): the difference is what that
quantize costs. Each function is replayed from a CUDA graph of CALLS calls, so the times are the
GPU's, not the host's launch overhead; those calls read one weight, so a weight that fits the L2
(50 MB on Hopper: 4096x4096 in bf16) is read from it after the first, faster than a model's
layers read theirs, unless ``--copies N`` has them read N copies of it in turn. GB/s counts the weight's bytes (codes and scales) once: at
decode row counts reading the weight is the whole cost, and H200 reads about 4.8 TB/s at best;
from a few hundred rows on the products set the pace instead. --pairs: each weight also as two
that read one activation (a SwiGLU's gate and up projections), "x2" rows: bf16 F.linear twice,
and for the FP8 formats (MXFP8 and NVFP4 at one row) two decode GEMM launches against one
(triton_decode.gemms_sharing_a), for MXFP8 and NVFP4 two launches of the mixed-input GEMM against
one (mixed_input.multiply of both), their speedup against bf16's two.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Callable

import torch
import torch.nn.functional as F
from tabulate import tabulate

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import alternate, graphed  # noqa: E402
from gemm import FORMATS as GEMM_FORMATS  # noqa: E402

from graphquant.kernels import backends, mixed_input, scaled_mm, triton_decode  # noqa: E402
from graphquant.quantizers import ROWWISE, Float8RowwiseQuantizer  # noqa: E402

EMULATION = backends.GemmBackend(backends.EMULATION)
TENSOR_CORES = triton_decode.DecodeConfig(tiles_per_sm=8)  # one of the autotuned tiles, at 8 programs an SM
BLOCK_SUMS = triton_decode.DecodeConfig(block_n=128, block_k=128, tiles_per_sm=4, mx_products="block sums")

WEIGHTS = [(4096, 4096), (14336, 4096), (4096, 14336)]
ROWS = [1, 16, 128, 2048]
CALLS = 20

# (activation's quantizer, weight's) of each recipe family, as gemm.py times them at large m.
FORMATS = {name.removesuffix(" (emulated on sm90)"): pair for name, pair in GEMM_FORMATS.items()}


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None and t.dim())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts, comma-separated")
    parser.add_argument("--formats", default=",".join(FORMATS), help="the formats timed beside bf16 and torch._scaled_mm")
    parser.add_argument("--weights", default=",".join(f"{n}x{k}" for n, k in WEIGHTS), help="weight shapes N x K, comma-separated")
    parser.add_argument("--pairs", action="store_true", help="each weight also as two that read one activation: two launches against one")
    parser.add_argument(
        "--copies", type=int, default=1,
        help="each weight in this many copies, the replayed calls reading them in turn: from the HBM, not the L2, where they add up to more than it holds",
    )
    args = parser.parse_args()
    pairs = args.pairs
    weights = [tuple(int(d) for d in shape.split("x")) for shape in args.weights.split(",")]
    row_counts = [int(r) for r in args.rows.split(",")]
    formats = {name: FORMATS[name] for name in args.formats.split(",")}
    rows = []
    for n, k in weights:
        for m in row_counts:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            built = [_functions(x, torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64, formats, pairs) for _ in range(args.copies)]
            fns, weight_bytes = {name: _cycling([each[name] for each, _ in built]) for name in built[0][0]}, built[0][1]
            replays, failed = {}, {}
            for name, fn in fns.items():
                try:
                    replays[name] = graphed(fn, CALLS)
                except RuntimeError as error:  # e.g. a shape torch._scaled_mm does not take
                    failed[name] = str(error).splitlines()[0][:60]
            times = alternate(replays, rounds=5)
            bf16_us = {twice: times["bf16 F.linear" + twice] * 1e3 / CALLS for twice in ("", " x2") if "bf16 F.linear" + twice in times}
            for name in fns:
                if name in failed:
                    rows.append([f"{n}x{k}", m, name, "", "", "", failed[name]])
                    continue
                us = times[name] * 1e3 / CALLS
                speedup = bf16_us[" x2" if " x2" in name else ""] / us
                rows.append([f"{n}x{k}", m, name, f"{us:.1f}", f"{weight_bytes[name] / us / 1e3:.0f}", f"{speedup:.2f}", ""])
                print(*rows[-1][:-1], sep="  ", flush=True)  # as it goes, should the run be cut short
    print(tabulate(rows, headers=["N x K", "M", "GEMM", "us", "weight GB/s", "speedup vs bf16", "note"]))


def _functions(x: torch.Tensor, w: torch.Tensor, formats: dict, pairs: bool) -> tuple[dict, dict]:
    """Each GEMM timed of x and weight w (bf16, then each format's, on each backend there is):
    the functions by name, and the weight bytes each reads."""
    m, k = x.shape
    n = w.shape[0]
    fns = {"bf16 F.linear": lambda: F.linear(x, w)}
    weight_bytes = {"bf16 F.linear": nbytes(w)}
    if pairs:
        w2 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
        fns["bf16 F.linear x2"] = lambda: (F.linear(x, w), F.linear(x, w2))
        weight_bytes["bf16 F.linear x2"] = 2 * nbytes(w)
    ra = Float8RowwiseQuantizer()(x, columnwise=False).get(ROWWISE)
    rb = Float8RowwiseQuantizer()(w, columnwise=False).get(ROWWISE)
    args, kwargs = scaled_mm.arguments(scaled_mm.ROWWISE_SCALED, ra, rb, torch.bfloat16)
    fns["torch._scaled_mm fp8 rowwise"] = lambda args=args, kwargs=kwargs: torch._scaled_mm(*args, **kwargs)
    weight_bytes["torch._scaled_mm fp8 rowwise"] = nbytes(rb.data, rb.scale)
    for name, (qa, qb) in formats.items():
        a = qa(x, columnwise=False).get(ROWWISE)
        b = qb(w, columnwise=False).get(ROWWISE)
        plan = backends.select(qa, ROWWISE, qb, ROWWISE, x.device, (m, n, k), 1, fast_accumulation=True)
        mixed = qb.gemm_input(ROWWISE).family in mixed_input.FORMATS and mixed_input.extension_runs(x.device)
        # x's values for the mixed-input GEMM made beforehand, as a graph makes them before the GEMM
        values, amax = (mixed_input.operand(a), mixed_input.a_amax(a)) if mixed else (None, None)
        planned_mixed = plan.backend.native is backends.MIXED_INPUT_GEMM  # then its "plan" row times it
        if plan.backend.native not in backends.DECODE_GEMMS:
            key = f"plan {name}: {plan.backend}"
            if planned_mixed:
                fns[key] = lambda v=values, amax=amax, b=b: backends.mixed_input_gemm(v, amax, [b], torch.bfloat16, [name], [None], stored_weight=True)[0]
            else:
                fns[key] = lambda a=a, b=b, backend=plan.backend: backends.gemm(a, b, 1, torch.bfloat16, backend, name)
            weight_bytes[key] = nbytes(b.data, b.scale, b.amax)
        if mixed and not planned_mixed:
            fns[f"wgmma mixed-input {name}"] = lambda v=values, amax=amax, b=b: mixed_input.multiply(v, amax, [b], torch.bfloat16)[0]
            weight_bytes[f"wgmma mixed-input {name}"] = nbytes(b.data, b.scale, b.amax)
        if pairs and mixed:  # a second weight read with x: two launches of the mixed-input GEMM against one
            b2 = qb(torch.randn_like(w) / 64, columnwise=False).get(ROWWISE)
            for label, fn in (
                ("two launches", lambda v=values, amax=amax, b=b, b2=b2: [mixed_input.multiply(v, amax, [one], torch.bfloat16) for one in (b, b2)]),
                ("one launch", lambda v=values, amax=amax, b=b, b2=b2: mixed_input.multiply(v, amax, [b, b2], torch.bfloat16)),
            ):
                fns[f"wgmma mixed-input {name} x2, {label}"] = fn
                weight_bytes[f"wgmma mixed-input {name} x2, {label}"] = 2 * nbytes(b.data, b.scale, b.amax)
        if m > triton_decode.MAX_ROWS[(qa.gemm_input(ROWWISE).family, qb.gemm_input(ROWWISE).family)]:
            continue
        fns[f"decode {name}"] = lambda a=a, b=b: triton_decode.gemm(a, b, torch.bfloat16)
        weight_bytes[f"decode {name}"] = nbytes(b.data, b.scale, b.amax)
        if not triton_decode.quantize_on_load_refusal(qa):
            on_load = triton_decode.QuantizedOnLoad(x, triton_decode.amaxes(x, qa), qa)
            fns[f"decode {name}, quantizing A"] = lambda a=on_load, b=b: triton_decode.gemm(a, b, torch.bfloat16)
            weight_bytes[f"decode {name}, quantizing A"] = weight_bytes[f"decode {name}"]
        if pairs and triton_decode.shares_launch(qb.gemm_input(ROWWISE).family, m):
            fns.update(_paired(name, x, w, qa, qb, weight_bytes))
        if "fp8_" not in qb.gemm_input(ROWWISE).family:  # dequantized: the emulation ran them before
            fns[f"emulated {name}"] = lambda a=a, b=b: backends.gemm(a, b, 1, torch.bfloat16, EMULATION, name)
            weight_bytes[f"emulated {name}"] = weight_bytes[f"decode {name}"]
            alternatives = {}
            if m == 1:  # the default there is the FMA units'
                alternatives["tensor cores"] = TENSOR_CORES
            if name == "mxfp8" and m <= 16:
                alternatives["block sums"] = BLOCK_SUMS
            for label, config in alternatives.items():
                fns[f"decode {name} ({label})"] = lambda a=a, b=b, config=config: triton_decode.gemm(a, b, torch.bfloat16, None, config)
                weight_bytes[f"decode {name} ({label})"] = weight_bytes[f"decode {name}"]
    return fns, weight_bytes


def _cycling(fns: list) -> Callable[[], object]:
    """A function whose successive calls call each of ``fns`` in turn, so that a CUDA graph of
    them reads each copy's weight in turn."""
    turn = itertools.cycle(fns)
    return lambda: next(turn)()


def _paired(name: str, x: torch.Tensor, w: torch.Tensor, qa, qb, weight_bytes: dict) -> dict:
    """The "x2" rows of one format: w and a second weight of its shape, both read with x (as
    quantized beforehand, and, FP8, quantized by the kernel), in two launches and in one."""
    w2 = torch.randn_like(w) / 64
    bs = [qb(weight, columnwise=False).get(ROWWISE) for weight in (w, w2)]
    a = qa(x, columnwise=False).get(ROWWISE)
    paired = {}
    operands = {"": a}
    if not triton_decode.quantize_on_load_refusal(qa):
        operands[", quantizing A"] = triton_decode.QuantizedOnLoad(x, triton_decode.amaxes(x, qa), qa)
    for label, operand in operands.items():
        paired[f"decode {name}{label} x2, two launches"] = lambda a=operand: [triton_decode.gemm(a, b, torch.bfloat16) for b in bs]
        paired[f"decode {name}{label} x2, one launch"] = lambda a=operand: triton_decode.gemms_sharing_a(a, bs, torch.bfloat16, [None, None])
    for key in paired:
        weight_bytes[key] = 2 * weight_bytes[f"decode {name}"]
    return paired


if __name__ == "__main__":
    main()
