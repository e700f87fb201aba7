"""graphquant.numerics: how far each quantized GEMM lands from the high-precision GEMM.

One forward and backward run the rewritten graph eagerly while graphquant.ops.recording records
every GEMM, computed as training computes it. For each site and GEMM (fprop, dgrad, wgrad) the
report gives the SQNR of the quantized result against the same GEMM on the high-precision
operands that entered the quantizers (a linear's bias added inside both GEMMs; the signal is the
product without it, so a large bias hides no error), and per operand what its format did: the
amax, the values that underflow to zero and the values that saturate. Sorted worst first, so
the sensitive layers stand at the top.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable, Optional

import torch
from tabulate import tabulate

from graphquant.explainer import run_once
from graphquant.kernels import grouped as grouped_kernels
from graphquant.kernels.backends import HIGH_PRECISION, GemmBackend
from graphquant.ops.library import unflatten
from graphquant.ops.operands import Operand, gemm as operand_gemm
from graphquant.ops.quantize import SlotState, quantize_tensor
from graphquant.ops.recording import RecordedGemm, recording
from graphquant.passes.plan import Plan
from graphquant.quantizers import IdentityQuantizer
from graphquant.recipes import CustomRecipe


@dataclasses.dataclass(frozen=True)
class OperandStats:
    """One operand of one GEMM and what its format did to it."""

    operand: str  # "grad_output.columnwise"
    format: str
    amax: float  # max |value| in high precision
    underflow: float  # of the values nonzero in high precision, those zero after quantization
    saturated: Optional[float]  # of all values, those clipped at the largest magnitude the format (and its scale)
    # can hold; None where the format cannot say (Quantizer.at_largest_code), shown "n/a"


@dataclasses.dataclass(frozen=True)
class GemmNumerics:
    site: str
    module_type: str
    gemm: str
    sqnr_db: float  # inf when the quantized GEMM is exact
    a: OperandStats
    b: OperandStats


@dataclasses.dataclass(frozen=True)
class NumericsReport:
    """Every recorded GEMM, worst SQNR first (NaN counts as worst)."""

    gemms: tuple[GemmNumerics, ...]

    def __str__(self) -> str:
        rows = []
        for g in self.gemms:
            for first, op in ((True, g.a), (False, g.b)):
                lead = [g.site, g.gemm, f"{g.sqnr_db:.1f}"] if first else ["", "", ""]
                rows.append(lead + [op.operand, op.format, f"{op.amax:.4g}", _percent(op.underflow), _percent(op.saturated)])
        headers = ["site", "gemm", "SQNR dB", "operand", "format", "amax", "underflow", "saturated"]
        table = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
        return "\n".join(line.rstrip() for line in table.splitlines())

    def to_json(self) -> str:
        """JSON with SQNR as a number, or the string "inf" / "nan" where it is not finite."""
        gemms = [dataclasses.asdict(g) | {"sqnr_db": _json_number(g.sqnr_db)} for g in self.gemms]
        return json.dumps({"gemms": gemms}, indent=2)


def _loss_fn_advice(output: Any) -> str:
    """The loss_fn to suggest: the model's own loss where it returns one (a transformers model given labels)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return "loss_fn=lambda output: output.loss, its own loss"
    return "loss_fn=... that makes it a scalar"


def numerics(
    model: Any,
    recipe: CustomRecipe,
    *example_inputs: Any,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
    example_kwargs: Optional[dict] = None,
    **compile_kwargs: Any,
) -> NumericsReport:
    """Run ``model`` forward and backward once under ``recipe`` and report every GEMM's numerics.

    loss_fn turns the model's output into the scalar to differentiate (default: output.sum());
    example_kwargs are the model's keyword inputs (an attention_mask, say).
    Gradients are taken with torch.autograd.grad, so no parameter's .grad changes. compile_kwargs
    are graphquant.compile's and torch.compile's, as for graphquant.explain, but for
    mode="inference" (no backward to measure).
    """
    if compile_kwargs.get("mode") == "inference":
        raise ValueError(
            "graphquant.numerics measures fprop, dgrad and wgrad from one forward and backward, and mode='inference' "
            "makes no backward: leave mode out; the fprop rows are the inference GEMMs' numerics too (inference "
            "quantizes each operand as training's fprop does)"
        )
    recorder = _Recorder()
    with torch.enable_grad(), recording(recorder):
        compiled, output = run_once(model, recipe, example_inputs, compile_kwargs, example_kwargs)
        if loss_fn is None and not isinstance(output, torch.Tensor):
            raise TypeError(f"the model returned a {type(output).__name__}; pass {_loss_fn_advice(output)}")
        loss = loss_fn(output) if loss_fn is not None else output.sum()
        parameters = model.parameters() if isinstance(model, torch.nn.Module) else ()
        leaves = [t for t in (*parameters, *example_inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if leaves:
            torch.autograd.grad(loss, leaves, allow_unused=True)
    return recorder.report(Plan.combine(compiled.graphquant.plans))


@dataclasses.dataclass
class _Counts:
    """Running sums for one operand of one GEMM (a site run several times adds up)."""

    amax: float = 0.0
    values: int = 0
    nonzero: int = 0
    underflow: int = 0
    saturated: int = 0
    saturation_unknown: bool = False  # a format that cannot say which codes are its largest

    def add(self, x: torch.Tensor, operand: Operand, row_group: Optional[torch.Tensor] = None, values: Optional[int] = None) -> None:
        """Count ``operand`` of ``x``; row_group: a grouped operand's (recording.Grouping: x lies
        in its padded layout, and ``values`` of its values are x's own, not padding)."""
        rep = unflatten(operand.tensors, operand.spec, operand.direction, operand.shape, x.dtype)
        if row_group is None:
            quantized = rep.dequantize(torch.float32)  # as stored (transposed where the format stores it so)
        else:
            quantized = grouped_kernels.dequantize(rep, row_group, torch.float32)
            quantized = quantized.t() if rep.transposed else quantized
        # Compared with what the format encoded: the values after its transform, if it has one.
        source = rep.quantizer.transformed(x.t() if rep.transposed else x, rep.direction).float()
        seen = x.abs().max().item() if x.numel() else 0.0
        self.amax = math.nan if math.isnan(seen) or math.isnan(self.amax) else max(self.amax, seen)  # Python's max drops a NaN
        self.values += x.numel() if values is None else values
        self.nonzero += int((source != 0).sum())
        self.underflow += int(((source != 0) & (quantized == 0)).sum())
        if not rep.quantizer.high_precision:  # which clips nothing
            at_max = rep.quantizer.at_largest_code(rep)
            if at_max is None:
                self.saturation_unknown = True
            else:  # beyond fp32 rounding of the scale: the value was clipped, not rounded
                self.saturated += int((at_max & (source.abs() > quantized.abs() * (1 + 1e-5))).sum())

    def stats(self, operand: str, format: str) -> OperandStats:
        saturated = None if self.saturation_unknown else self.saturated / max(self.values, 1)
        return OperandStats(operand, format, self.amax, self.underflow / max(self.nonzero, 1), saturated)


class _Recorder:
    """The recorder of graphquant.ops.recording: per (site, gemm), the result's signal and error energy and both
    operands' counts. It keeps numbers only, never the tensors."""

    def __init__(self) -> None:
        self.energy: dict[tuple[str, str], list[float]] = {}
        self.counts: dict[tuple[str, str], tuple[_Counts, _Counts]] = {}

    @torch.no_grad()
    def __call__(self, gemm: RecordedGemm) -> None:
        key, grouping = (gemm.site.label, gemm.gemm), gemm.grouping
        reference = (_high_precision_gemm(gemm) if grouping is None else grouping.high_precision).double()
        product = reference if gemm.bias is None else reference - gemm.bias.double()
        energy = self.energy.setdefault(key, [0.0, 0.0])
        energy[0] += product.square().sum().item()
        energy[1] += (gemm.out.double().reshape(reference.shape) - reference).square().sum().item()
        counts = self.counts.setdefault(key, (_Counts(), _Counts()))
        if grouping is None:
            counts[0].add(gemm.a, gemm.a_operand)
            counts[1].add(gemm.b, gemm.b_operand)
        else:
            counts[0].add(gemm.a, gemm.a_operand, grouping.a_group, grouping.values[0])
            counts[1].add(gemm.b, gemm.b_operand, grouping.b_group, grouping.values[1])

    def report(self, plan: Plan) -> NumericsReport:
        planned = {(g.site, g.gemm): g for g in plan.gemms}
        gemms = []
        for key, (signal, noise) in self.energy.items():
            g = planned[key]
            a, b = self.counts[key]
            sqnr = _sqnr_db(signal, noise)
            gemms.append(GemmNumerics(g.site, g.module_type, g.gemm, sqnr, a.stats(g.a, g.a_format), b.stats(g.b, g.b_format)))
        gemms.sort(key=lambda g: (not math.isnan(g.sqnr_db), g.sqnr_db))
        return NumericsReport(tuple(gemms))


def _high_precision_gemm(gemm: RecordedGemm) -> torch.Tensor:
    """The same GEMM (same directions, grouping, bias and output dtype) on the unquantized operands."""
    state = SlotState(None, None, 0)
    a, b = gemm.a_operand.direction, gemm.b_operand.direction
    hp_a = quantize_tensor(gemm.a, IdentityQuantizer(), (a,), state)[0][a]
    hp_b = quantize_tensor(gemm.b, IdentityQuantizer(), (b,), state)[0][b]
    where = f"{gemm.site.label} {gemm.gemm}"
    return operand_gemm(hp_a, hp_b, gemm.batch, gemm.out.dtype, GemmBackend(HIGH_PRECISION), where, gemm.bias)


def _sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise): inf when the quantized GEMM is exact, NaN where a value was NaN."""
    if noise == 0:
        return math.inf
    ratio = signal / noise
    return 10 * math.log10(ratio) if ratio > 0 else (math.nan if math.isnan(ratio) else -math.inf)


def _percent(fraction: Optional[float]) -> str:
    """A share in two significant digits (all of them from 99.5% on: 99.6%, 100%)."""
    if fraction is None:
        return "n/a"
    percent = 100 * fraction
    return "0" if fraction == 0 else f"{percent:.2g}%" if percent < 99.5 else f"{percent:.3g}%"


def _json_number(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)
