"""The eager reference of a graphquant recipe, independent of graphquant's compiler.

It uses only graphquant.quantizers (the reference numerics of every format), graphquant.roles
(the factory's argument) and the recipe's factory: never graphquant.ops, graphquant.passes,
graphquant.passes.plan or graphquant.compiler. It re-derives, from the design document alone:

- which calls are GEMMs and their roles (design "Roles in a plain PyTorch graph"): F.linear,
  matmul / mm / addmm with a 2-D Parameter as right operand, and an einsum of no batch letters
  with a Parameter as its second operand, are ``linear`` (input, weight, grad_output); matmul /
  mm / bmm / addmm / baddbmm / einsum between activations are ``matmul`` (input, other,
  grad_output). The right operand b of a matmul is
  quantized as w = b^T, an (n, k) matrix, so both operands are reduced over their last dim;
- names: the owner's ``named_modules()`` name; a GEMM that is not an nn.Linear's own gets
  ``<owner>.<linear|matmul>.<i>``, i counted per owner call; a module called twice keeps one
  name and its calls are numbered 0, 1, ...;
- the three GEMMs (design "The three GEMMs of a linear"), y = x w^T per batch group:
      fprop  y  = x.rowwise            @ w.rowwise^T
      dgrad  dx = grad_output.rowwise  @ w.columnwise
      wgrad  dw = grad_output.columnwise^T @ x.columnwise
  each operand quantized with the slot's quantizer (a HybridQuantizer's rowwise / columnwise
  child; columnwise_source="rowwise_dequantized" quantizes the dequantized rowwise values),
  dequantized exactly, and multiplied in float64; the result is rounded to the GEMM's dtype.
  A batched operand is quantized as one 2-D tensor (groups stacked along the rows);
- torch._grouped_mm(x (T, K), w (E, K, N), offs) is ``grouped_linear`` (input, weight,
  grad_output), named like a matmul: expert g's rows x[offs[g-1]:offs[g]] and W_g = w[g]^T
  (N, K) are one linear's GEMMs, every group's operands quantized alone (TE's GroupedLinear);
  where one of the site's formats rounds stochastically, each group's tensors are quantized as
  their part of the op's padded layout (graphquant.ops.grouped), whose shape the draws depend on;
- the compiler's state contracts, which a reference must share to reproduce its bits:
  * stochastic rounding: a forward call is step s = 1, 2, ... (its backward uses the same
    step); quantizing tensor t (0 input, 1 weight/other, 2 grad_output) of the i-th GEMM of the
    graph uses QuantizeContext(seed, offset = s * STREAMS_PER_STEP + 3 i + t);
  * delayed scaling: a slot starts at scale 1 with a zero amax history; each quantize of the
    slot uses its current scale and records max|x|; the step's largest (a module called twice
    quantizes twice a step) then computes the next scale with TE's rule (``delayed_update``
    below), here before the slot's first quantize of the next step or a read of ``delayed``.

Teacher forcing (``GemmTape``): the compiled model's GEMM results are recorded; the
reference checks each of its GEMMs against the matching recorded result (within the fp32
accumulation bound of its float64 product, ``gemm_bound``) and then continues with the recorded
value, so both sides feed bit-identical values to every later quantizer. Without it, a GEMM
result that is exactly a rounding tie of the next quantizer (products of low-precision values are
short binary fractions) can round one way in float64 and the other after fp32 accumulation, and
the two runs part by a whole FP8 / FP4 step (test_compile_numerics.test_float64_chain_can_split_at_ties).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from graphquant.formats import fp8
from graphquant.quantizers import (
    COLUMNWISE,
    ROWWISE,
    DelayedScalingRequest,
    Float8DelayedScalingQuantizer,
    HybridQuantizer,
    QuantizeContext,
    Quantizer,
    Representation,
)
from graphquant.roles import QuantizerRole

STREAMS_PER_STEP = 1 << 16  # graphquant's documented contract; tests check the library agrees
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
TENSOR_TYPES = {
    "linear": ("input", "weight", "grad_output"),
    "matmul": ("input", "other", "grad_output"),
    "grouped_linear": ("input", "weight", "grad_output"),
}
EPS32 = 2.0**-24  # unit roundoff of fp32


# -- quantize / dequantize, honouring hybrids ---------------------------------------------------

def ref_quantize(x: torch.Tensor, quantizer: Quantizer, direction: str, ctx: QuantizeContext) -> Representation:
    """One direction of 2-D ``x``: a hybrid's child for that direction, from the original or
    from the dequantized rowwise representation as its columnwise_source says."""
    if isinstance(quantizer, HybridQuantizer):
        if direction == ROWWISE:
            return ref_quantize(x, quantizer.rowwise_quantizer, ROWWISE, ctx)
        source = x
        if quantizer.columnwise_source == "rowwise_dequantized":
            source = ref_dequantize(ref_quantize(x, quantizer.rowwise_quantizer, ROWWISE, ctx)).to(x.dtype)
        return ref_quantize(source, quantizer.columnwise_quantizer, COLUMNWISE, ctx)
    quantizer.check_shape(tuple(x.shape), direction)
    if direction == ROWWISE:
        return quantizer.quantize_rowwise(x, ctx)
    return quantizer.quantize_columnwise(x, ctx)


def ref_dequantize(rep: Representation) -> torch.Tensor:
    """The (rows, cols) values ``rep`` stands for, in float64 (exact: every format decodes to
    fp32 values). A columnwise representation with a Hadamard transform gives the transformed
    values: the wgrad product of two transformed operands is unchanged (H^T H = I)."""
    values = rep.quantizer.dequantize(rep)
    if rep.transposed:
        values = values.t()
    assert tuple(values.shape) == tuple(rep.shape), (values.shape, rep.shape)
    return values.to(torch.float64)


def delayed_update(scale: torch.Tensor, history: torch.Tensor, amax: torch.Tensor, q: Float8DelayedScalingQuantizer):
    """TE's delayed-scaling update, written out: history[0] = amax; amax_used = max(history)
    ("max") or history[0] ("most_recent"); scale = fp8_max / amax_used / 2^margin (kept when
    amax_used is 0 or not finite; inf -> FLT_MAX); then roll the history by one and zero slot 0."""
    history = history.clone()
    history[0] = amax.float()
    used = history.max() if q.amax_compute_algo == "max" else history[0]
    new_scale = scale.clone()
    if torch.isfinite(used) and used > 0:
        value = torch.tensor(FP8_MAX[q.fp8_dtype], dtype=torch.float32) / used.float() / 2.0**q.margin
        new_scale = torch.where(torch.isinf(value), torch.tensor(torch.finfo(torch.float32).max), value).reshape(1)
    history = torch.roll(history, -1)
    history[0] = 0.0
    return new_scale, history


# -- the GEMM ----------------------------------------------------------------------------------

@dataclasses.dataclass
class RefSite:
    name: str
    call: int
    module_type: str
    index: int  # position among the quantized GEMMs of this forward
    quantizers: tuple[Quantizer, Quantizer, Quantizer]
    roles: tuple[QuantizerRole, QuantizerRole, QuantizerRole]
    batch: int
    reference: Reference

    def row_block(self) -> int:
        """The most rows one scale block of the site's formats spans (1 where none spans rows)."""
        return max(1, *(q.block(d)[0] for q in self.quantizers for d in (ROWWISE, COLUMNWISE)))

    def quantize(self, t: int, x: torch.Tensor, directions: tuple[str, ...], group: Optional[int] = None) -> dict[str, torch.Tensor]:
        """Float64 dequantized values of tensor ``t`` of this site in ``directions``; ``group``:
        the expert of a grouped site, whose delayed-scaling slot is its own."""
        quantizer = self.quantizers[t]
        ref = self.reference
        delayed = isinstance(quantizer, Float8DelayedScalingQuantizer)
        scale = ref.slot(self.delayed_key(t, group))[0] if delayed else None
        ctx = QuantizeContext(scale=scale, seed=ref.seed, offset=ref.step * STREAMS_PER_STEP + 3 * self.index + t)
        out = {d: ref_dequantize(ref_quantize(x, quantizer, d, ctx)) for d in directions}
        if directions:
            self.record_delayed(t, group, x.detach().abs().max())
        return out

    def delayed_key(self, t: int, group: Optional[int]) -> Any:
        """Where ``reference.delayed`` keeps tensor ``t``'s slot: its role, or (role, expert)."""
        role = self.roles[t]
        if group is None:
            return role
        self.reference._delayed.setdefault((role, group), (torch.ones(1), torch.zeros(self.quantizers[t].amax_history_len)))
        return (role, group)

    def record_delayed(self, t: int, group: Optional[int], amax: torch.Tensor) -> None:
        """Record ``amax`` in tensor ``t``'s delayed-scaling slot (if it keeps one) for this step."""
        quantizer = self.quantizers[t]
        if isinstance(quantizer, Float8DelayedScalingQuantizer):
            ref, key = self.reference, self.delayed_key(t, group)
            ref.slot(key)
            _, seen = ref.pending.get(key, (ref.step, amax))
            ref.pending[key] = (ref.step, torch.maximum(seen, amax))


def _gemm64(a: torch.Tensor, b: torch.Tensor, what: str, site: RefSite, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a (g, m, k) @ b (g, k, n) (+ bias) in float64.

    Logs the GEMM's fp32 bound per output (``gemm_bound``),
    plus one rounding of the result where the GEMM adds a bias before rounding.
    With a tape (teacher forcing), checks that the compiled model ran a GEMM whose result lies
    within that bound of this one, and returns the compiled result, so that what follows sees
    exactly the values the compiled model saw.
    """
    exact = torch.bmm(a, b)
    bound = gemm_bound(a, b)
    if bias is not None:
        exact = exact + bias.double()
        bound = bound + EPS32 * exact.abs()
    return _checked(exact, bound, a.shape[-1], what, site)


def _grouped_gemm64(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], stack: bool, dtype: torch.dtype, what: str, site: RefSite
) -> torch.Tensor:
    """a_g (m_g, k_g) @ b_g (k_g, n) for each group in float64, as torch._grouped_mm's GEMMs give
    them: the groups' rows one after another, or with ``stack`` (wgrad) one (m, n) per group;
    logged and teacher-forced as ``_gemm64``, the bound widened by the one rounding of the result
    to ``dtype`` (bfloat16: torch._grouped_mm's only dtype on CPU)."""
    products = [(a @ b, gemm_bound(a.unsqueeze(0), b.unsqueeze(0))[0]) for a, b in pairs]
    join = torch.stack if stack else torch.cat
    exact, bound = join([p for p, _ in products]), join([b for _, b in products])
    bound = bound + torch.finfo(dtype).eps / 2 * exact.abs()
    return _checked(exact, bound, max(a.shape[-1] for a, _ in pairs), what, site)


def _checked(exact: torch.Tensor, bound: torch.Tensor, k: int, what: str, site: RefSite) -> torch.Tensor:
    """Log a GEMM's bound; with a tape, the compiled result within it (see ``_gemm64``)."""
    ref = site.reference
    ref.gemm_log.append((site.name, site.call, what, k, bound.max().item() if bound.numel() else 0.0))
    if ref.tape is None:
        return exact
    return ref.tape.take(exact, bound, f"{site.name}#{site.call} {what}").double()


def gemm_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How far an fp32 GEMM of the same operands may lie from the exact product, per output.

    Its sums in fp32 are within fp8.accumulation_bound(a, b, fp8.FP32) of the exact ones where
    the products are exact, and one rounding of each product (u sum_k |a_k||b_k|, u = 2^-24) away
    where fp32 operands make them inexact. The compiled emulation also takes per-tensor / per-row
    factors (FP8 scale_inv, NVFP4 global amax / 2688) out of the operands and applies them to the
    product (two more roundings, 2u of the result), and the reference's own dequantized operands
    are fp32 values rounded once each (2u): 5u sum_k |a_k||b_k| besides the sums.
    """
    return fp8.accumulation_bound(a, b, fp8.FP32) + 5 * EPS32 * torch.bmm(a.abs(), b.abs())


class GemmTape:
    """The results of the graphquant::gemm and graphquant::grouped_gemm calls of compiled runs,
    for teacher forcing.

    ``backend`` is an inner backend for graphquant.compile: aot_eager (same partitioner, no
    compiler) whose graphs run through an fx.Interpreter that appends every graphquant::gemm
    result to the tape. The reference then takes, for each of its GEMMs, the unused tape entry of
    the same shape closest to its own float64 product, and checks it is within the fp32 bound.
    It also keeps the tensors the latest backward graph received from the forward (``saved``).
    """

    def __init__(self) -> None:
        self.entries: list[torch.Tensor] = []
        self.used: list[bool] = []
        self.saved: list[torch.Tensor] = []  # the latest backward's saved tensors

    @property
    def backend(self) -> Callable:
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        tape = self

        class Recorder(torch.fx.Interpreter):
            def call_function(self, target, args, kwargs):
                out = super().call_function(target, args, kwargs)
                if target in (torch.ops.graphquant.gemm.default, torch.ops.graphquant.grouped_gemm.default):
                    tape.entries.append(out.detach().clone())
                    tape.used.append(False)
                return out

        def compiler(gm: torch.fx.GraphModule, example_inputs, backward: bool = False):
            names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]

            def run(args):
                if backward:  # what the forward saved for it: every input but the tangents
                    tape.saved = [a for name, a in zip(names, args) if not name.startswith("tangents")]
                return Recorder(gm).boxed_run(args)

            run._boxed_call = True
            return run

        return aot_autograd(
            fw_compiler=compiler,
            bw_compiler=lambda gm, example_inputs: compiler(gm, example_inputs, backward=True),
            partition_fn=min_cut_rematerialization_partition,
            keep_inference_input_mutations=True,
        )

    def take(self, exact: torch.Tensor, bound: torch.Tensor, what: str) -> torch.Tensor:
        best, best_excess = None, math.inf
        for i, entry in enumerate(self.entries):
            if self.used[i] or entry.shape != exact.shape:
                continue
            excess = ((entry.double() - exact).abs() - bound).max().item()
            if excess < best_excess:
                best, best_excess = i, excess
        assert best is not None, f"{what}: the compiled model ran no (further) GEMM of shape {tuple(exact.shape)}"
        if best_excess > 0:
            entry = self.entries[best].double()
            bad = ((entry - exact).abs() > bound)
            worst = int(((entry - exact).abs() - bound).argmax())
            raise AssertionError(
                f"{what}: no GEMM of the compiled model matches the reference to fp32 accumulation error; "
                f"the closest differs in {int(bad.sum())} of {bad.numel()} outputs, worst "
                f"{entry.flatten()[worst].item()!r} vs {exact.flatten()[worst].item()!r} "
                f"(bound {bound.flatten()[worst].item():.3g})"
            )
        self.used[best] = True
        return self.entries[best]

    def assert_all_taken(self) -> None:
        left = [tuple(e.shape) for e, used in zip(self.entries, self.used) if not used]
        assert not left, f"the compiled model ran {len(left)} GEMMs the reference did not: shapes {left}"

    def clear(self) -> None:
        self.entries, self.used = [], []


class RefGemm(torch.autograd.Function):
    """y (g, m, n) = x (g*m, k) @ w (g*n, k)^T per group g, through the site's formats."""

    @staticmethod
    def forward(ctx, x2d: torch.Tensor, w2d: torch.Tensor, bias: Optional[torch.Tensor], site: RefSite):
        g = site.batch
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        xq = site.quantize(0, x2d, (ROWWISE, COLUMNWISE) if need_dw else (ROWWISE,))
        wq = site.quantize(1, w2d, (ROWWISE, COLUMNWISE) if need_dx else (ROWWISE,))
        m, k, n = x2d.shape[0] // g, x2d.shape[1], w2d.shape[0] // g
        y = _gemm64(xq[ROWWISE].view(g, m, k), wq[ROWWISE].view(g, n, k).transpose(1, 2), "fprop", site, bias)
        site.reference.operands.append((f"{site.name}#{site.call}", x2d.detach(), w2d.detach()))
        ctx.site, ctx.shapes, ctx.dtypes = site, (g, m, k, n), (x2d.dtype, w2d.dtype)
        ctx.save_for_backward(xq.get(COLUMNWISE), wq.get(COLUMNWISE))
        return y.to(torch.promote_types(x2d.dtype, w2d.dtype))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_col, w_col = ctx.saved_tensors
        site, (g, m, k, n) = ctx.site, ctx.shapes
        need_dx, need_dw, need_dbias = ctx.needs_input_grad[:3]
        directions = ((ROWWISE,) if need_dx else ()) + ((COLUMNWISE,) if need_dw else ())
        gq = site.quantize(2, dy.reshape(g * m, n), directions)
        dbias = dy.reshape(g * m, n).float().sum(0).to(dy.dtype) if need_dbias else None
        dx = dw = None
        if need_dx:
            dx = _gemm64(gq[ROWWISE].view(g, m, n), w_col.view(g, n, k), "dgrad", site)
            dx = dx.reshape(g * m, k).to(ctx.dtypes[0])
        if need_dw:
            dw = _gemm64(gq[COLUMNWISE].view(g, m, n).transpose(1, 2), x_col.view(g, m, k), "wgrad", site)
            dw = dw.reshape(g * n, k).to(ctx.dtypes[1])
        return dx, dw, dbias, None


class RefGroupedGemm(torch.autograd.Function):
    """y (T, N) = torch._grouped_mm(x (T, K), w (E, K, N), offs): row group g of x times W_g^T,
    W_g = w[g]^T (N, K), through the site's formats with every group's operands quantized alone,
    zero-padded to whole blocks of every format of the site (TE pads groups so): the values of
    the pad rows are dropped, except in wgrad, whose two operands keep them (zeros, or what a
    Hadamard transform mixed into them, which the product undoes)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, site: RefSite):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        bounds = [0] + offs.tolist()
        rows = list(zip(bounds, bounds[1:]))
        n = w.shape[2]
        parts = _GroupParts.of(site, [b - a for a, b in rows], n)
        xq = [
            _quantize_group(site, 0, x[a:b], part, x.shape[1], (ROWWISE, COLUMNWISE) if need_dw else (ROWWISE,), g)
            for g, ((a, b), part) in enumerate(zip(rows, parts.token_rows))
        ]
        wq = [
            _quantize_group(site, 1, w[g].t(), parts.weight_rows, w.shape[1], (ROWWISE, COLUMNWISE) if need_dx else (ROWWISE,), g)
            for g in range(len(rows))
        ]
        dtype = torch.promote_types(x.dtype, w.dtype)
        pairs = [(xg[ROWWISE][: b - a], wg[ROWWISE][:n].t()) for (a, b), xg, wg in zip(rows, xq, wq)]
        y = _grouped_gemm64(pairs, False, dtype, "fprop", site)
        site.reference.operands.append((f"{site.name}#{site.call}", x.detach(), w.detach()))
        # Eager only: the columnwise operands stay on ctx as lists, one tensor per group.
        ctx.site, ctx.rows, ctx.dtypes, ctx.parts, ctx.n = site, rows, (x.dtype, w.dtype), parts, n
        ctx.x_col, ctx.w_col = [q.get(COLUMNWISE) for q in xq], [q.get(COLUMNWISE) for q in wq]
        return y.to(dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        directions = ((ROWWISE,) if need_dx else ()) + ((COLUMNWISE,) if need_dw else ())
        parts = ctx.parts
        gq = [
            _quantize_group(ctx.site, 2, dy[a:b], part, parts.grad_cols, directions, g)
            for g, ((a, b), part) in enumerate(zip(ctx.rows, parts.token_rows))
        ]
        dx = dw = None
        x_dtype, w_dtype = ctx.dtypes
        if need_dx:
            pairs = [(g[ROWWISE][: b - a], w[: ctx.n]) for (a, b), g, w in zip(ctx.rows, gq, ctx.w_col)]
            dx = _grouped_gemm64(pairs, False, x_dtype, "dgrad", ctx.site).to(x_dtype)
        if need_dw:  # dW_g^T (N, K), one per group, as the wgrad GEMM writes them
            dw_t = _grouped_gemm64([(g[COLUMNWISE].t(), x) for g, x in zip(gq, ctx.x_col)], True, w_dtype, "wgrad", ctx.site)
            dw = dw_t.transpose(1, 2).to(w_dtype)
        return dx, dw, None, None


# graphquant.ops.grouped's padded layout: every group starts at a multiple of this many rows.
OP_GROUP_ROWS = 128


def _whole(size: int, block: int) -> int:
    return -(-size // block) * block


@dataclasses.dataclass(frozen=True)
class _GroupParts:
    """The zero-padded shape each group's tensors are quantized in: the rows of each group of
    tokens (x, grad_output), of each W_g, and grad_output's columns.

    Whole blocks of the site's formats suffice for values. Stochastic rounding's draws also
    depend on the shape, so a site with it takes the op's padded layout (graphquant.ops.grouped):
    groups of whole OP_GROUP_ROWS, the last group of tokens running on to the layout's end (room
    for T rows in the groups that can hold one, at most min(T, E) and at least one, each padded by
    up to OP_GROUP_ROWS - 1, in whole OP_GROUP_ROWS), and grad_output's N columns as many as W's
    padded rows."""

    token_rows: list[int]
    weight_rows: int
    grad_cols: int

    @staticmethod
    def of(site: RefSite, sizes: list[int], n: int) -> _GroupParts:
        if not any(q.stochastic for q in site.quantizers):
            block = site.row_block()
            return _GroupParts([_whole(m, block) for m in sizes], _whole(n, block), n)
        token_rows = [_whole(m, OP_GROUP_ROWS) for m in sizes]
        layout_rows = _whole(sum(sizes) + max(min(sum(sizes), len(sizes)), 1) * (OP_GROUP_ROWS - 1), OP_GROUP_ROWS)
        token_rows[-1] = layout_rows - sum(token_rows[:-1])
        return _GroupParts(token_rows, _whole(n, OP_GROUP_ROWS), _whole(n, OP_GROUP_ROWS))


def _quantize_group(
    site: RefSite, t: int, x: torch.Tensor, rows: int, cols: int, directions: tuple[str, ...], group: int
) -> dict[str, torch.Tensor]:
    """``site.quantize`` of group ``group``'s rows, zero-padded to ``rows`` rows and ``cols``
    columns, with the padded columns dropped again; an empty group has no values to quantize (its
    products are empty, or zero), and its delayed-scaling slot sees amax 0."""
    if x.shape[0] == 0:
        if directions:
            site.record_delayed(t, group, torch.zeros(()))
        return {d: x.new_zeros(x.shape, dtype=torch.float64) for d in directions}
    padded = F.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))
    return {d: v[:, : x.shape[1]] for d, v in site.quantize(t, padded, directions, group).items()}


# -- finding GEMMs in eager code ---------------------------------------------------------------

_LINEAR = {F.linear}
_MATMUL = {torch.matmul, torch.mm, torch.bmm, torch.Tensor.matmul, torch.Tensor.mm, torch.Tensor.bmm, torch.Tensor.__matmul__}
_ADDMM = {torch.addmm, torch.baddbmm, torch.Tensor.addmm, torch.Tensor.baddbmm}
_EINSUM = {torch.einsum}


def _einsum_layout(equation: str, a_shape, b_shape):
    """(a_perm, b_perm, batch, m, n, k sizes, y letters order, out permutation) of a two-operand
    einsum that is one batched matrix product, else None."""
    equation = equation.replace(" ", "")
    if "->" not in equation or "." in equation:
        return None
    ins, out = equation.split("->")
    if ins.count(",") != 1:
        return None
    a, b = ins.split(",")
    batch = [c for c in out if c in a and c in b]
    ms = [c for c in out if c in a and c not in b]
    ns = [c for c in out if c in b and c not in a]
    ks = [c for c in a if c in b and c not in out]
    if sorted(a) != sorted(batch + ms + ks) or sorted(b) != sorted(batch + ns + ks) or sorted(out) != sorted(batch + ms + ns):
        return None
    size = {c: a_shape[a.index(c)] for c in a} | {c: b_shape[b.index(c)] for c in b}
    y_letters = batch + ms + ns
    return dict(
        a_perm=[a.index(c) for c in batch + ms + ks],
        b_perm=[b.index(c) for c in batch + ns + ks],
        batched=bool(batch),
        g=math.prod(size[c] for c in batch),
        m=math.prod(size[c] for c in ms),
        n=math.prod(size[c] for c in ns),
        k=math.prod(size[c] for c in ks),
        y_shape=[size[c] for c in y_letters],
        out_perm=[y_letters.index(c) for c in out],
    )


class _GemmMode(TorchFunctionMode):
    def __init__(self, reference: Reference):
        super().__init__()
        self.ref = reference

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        handled = self.ref.handle(func, args, kwargs)
        return func(*args, **kwargs) if handled is NotImplemented else handled


class Reference:
    """Runs ``model`` eagerly with every GEMM through ``RefGemm`` in the recipe's formats.

    reference = Reference(model, recipe, seed=0); y = reference(x); y.sum().backward()
    ``factory_calls``, ``quantizers`` (role -> quantizer), ``sites`` (name, call, module_type)
    of the latest forward, ``delayed`` (role -> (scale, history)), ``operands`` (site label and
    2-D operands of each GEMM of the latest forward) and ``gemm_log`` (name, call, gemm, K,
    largest gemm_bound) describe what it did. With ``tape``, it is teacher-forced (see above).
    """

    def __init__(self, model: nn.Module, recipe: Any, *, seed: int = 0, tape: GemmTape | None = None):
        self.model = model
        self.tape = tape
        self.factory: Callable = recipe.qfactory
        self.seed = seed
        self.step = 0
        self.factory_calls = 0
        self.quantizers: dict[QuantizerRole, Quantizer] = {}
        self._delayed: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pending: dict[Any, tuple[int, torch.Tensor]] = {}  # slot -> (step, the step's largest amax so far)
        self.sites: list[tuple[str, int, str]] = []
        self.gemm_log: list[tuple] = []
        self.operands: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (site label, x 2-D, w 2-D)
        self._stack: list[tuple[str, int, bool]] = []

    # slots
    def quantizer(self, role: QuantizerRole) -> Quantizer:
        if role not in self.quantizers:
            self.factory_calls += 1
            answer = self.factory(role)
            if isinstance(answer, DelayedScalingRequest):
                answer = answer.resolve(role.backward)
            assert isinstance(answer, Quantizer), (role, answer)
            self.quantizers[role] = answer
            if isinstance(answer, Float8DelayedScalingQuantizer):
                self._delayed[role] = (torch.ones(1), torch.zeros(answer.amax_history_len))
        return self.quantizers[role]

    @property
    def delayed(self) -> dict[Any, tuple[torch.Tensor, torch.Tensor]]:
        """Each delayed-scaling slot's (scale, history) after the steps run so far."""
        for key in list(self.pending):
            self._roll(key)
        return self._delayed

    def slot(self, key: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot's (scale, history) as this step's quantizes read it: an earlier step's amax rolled in."""
        if key in self.pending and self.pending[key][0] < self.step:
            self._roll(key)
        return self._delayed[key]

    def _roll(self, key: Any) -> None:
        _, amax = self.pending.pop(key)
        role = key[0] if isinstance(key, tuple) else key
        self._delayed[key] = delayed_update(*self._delayed[key], amax, self.quantizers[role])

    # running
    def __call__(self, *args, **kwargs):
        self.step += 1
        self.sites = []
        self.operands = []
        self._calls: dict[str, int] = {}
        self._functional: dict[tuple[str, int, str], int] = {}
        with self._module_stack(), _GemmMode(self):
            return self.model(*args, **kwargs)

    @contextlib.contextmanager
    def _module_stack(self):
        handles = []
        for name, module in self.model.named_modules():

            def pre(mod, args, name=name):
                call = self._calls.get(name, 0)
                self._calls[name] = call + 1
                self._stack.append((name, call, isinstance(mod, nn.Linear)))

            def post(mod, args, output):
                self._stack.pop()

            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._stack.clear()

    def _site(self, kind: str, batch: int) -> RefSite:
        owner, call, owner_is_linear = self._stack[-1] if self._stack else ("", 0, False)
        if kind == "linear" and owner_is_linear:
            name = owner
        else:
            key = (owner, call, kind)
            index = self._functional.get(key, 0)
            self._functional[key] = index + 1
            name = ".".join(p for p in (owner, kind, str(index)) if p)
        roles = tuple(QuantizerRole(kind, t, name) for t in TENSOR_TYPES[kind])
        quantizers = tuple(self.quantizer(r) for r in roles)
        site = RefSite(name, call, kind, len(self.sites), quantizers, roles, batch, self)
        self.sites.append((name, call, kind))
        return site

    def handle(self, func, args, kwargs):
        if func in _LINEAR:
            x, w = args[0], kwargs.pop("weight", None) if len(args) < 2 else args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            k = x.shape[-1]
            y = RefGemm.apply(x.reshape(-1, k), w, bias, self._site("linear", 1))  # the bias inside, as graphquant adds it
            return y.reshape(*x.shape[:-1], w.shape[0])
        if func in _MATMUL:
            return self._matmul(args[0], args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2")))
        if func in _ADDMM:
            c, a, b = args[:3]
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            product = self._matmul(a, b)
            product = product if alpha == 1 else alpha * product
            return product + (c if beta == 1 else beta * c)
        if func is torch._grouped_mm:
            named = dict(zip(("mat_a", "mat_b", "offs"), args)) | kwargs
            x, w, offs = named["mat_a"], named["mat_b"], named.get("offs")
            if x.dim() != 2 or w.dim() != 3 or offs is None or set(named) - {"mat_a", "mat_b", "offs"}:
                return NotImplemented
            return RefGroupedGemm.apply(x, w, offs, self._site("grouped_linear", 1))
        if func in _EINSUM:
            equation, *operands = args
            if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
                operands = list(operands[0])
            if len(operands) != 2:
                return NotImplemented
            a, b = operands
            layout = _einsum_layout(equation, a.shape, b.shape)
            if layout is None:
                return NotImplemented
            x = a.permute(layout["a_perm"]).reshape(layout["g"] * layout["m"], layout["k"])
            w = b.permute(layout["b_perm"]).reshape(layout["g"] * layout["n"], layout["k"])
            kind = "linear" if isinstance(b, nn.Parameter) and not layout["batched"] else "matmul"
            y = RefGemm.apply(x, w, None, self._site(kind, layout["g"]))
            return y.reshape(layout["y_shape"]).permute(layout["out_perm"])
        return NotImplemented

    def _matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if a.dim() < 2 or b.dim() < 2:
            return torch.matmul(a, b)  # matrix-vector products are not quantized
        k = a.shape[-1]
        if b.dim() == 2:
            kind = "linear" if isinstance(b, nn.Parameter) else "matmul"
            y = RefGemm.apply(a.reshape(-1, k), b.t(), None, self._site(kind, 1))
            return y.reshape(*a.shape[:-1], b.shape[-1])
        if tuple(a.shape[:-2]) != tuple(b.shape[:-2]):
            return torch.matmul(a, b)  # broadcast batch dims are not quantized
        batch = a.shape[:-2]
        g = math.prod(batch)
        y = RefGemm.apply(a.reshape(-1, k), b.transpose(-1, -2).reshape(-1, k), None, self._site("matmul", g))
        return y.reshape(*batch, a.shape[-2], b.shape[-1])


# -- running and comparing -----------------------------------------------------------------------

def grad_output_like(y: torch.Tensor, seed: int = 1234) -> torch.Tensor:
    """A fixed, dense upstream gradient (every output contributes to every gradient), drawn on the
    CPU so that every device sees the same values."""
    return torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype).to(y.device)


def forward_backward(run: Callable, model: nn.Module, x: torch.Tensor, *, grad_seed: int = 1234) -> dict[str, torch.Tensor]:
    """One training step's results: the output, the input's gradient (float inputs) and every
    parameter's gradient, by name. ``run`` is the compiled model or a Reference of ``model``."""
    x = x.detach().clone().requires_grad_(x.is_floating_point())
    for p in model.parameters():
        p.grad = None
    y = run(x)
    y.backward(grad_output_like(y, grad_seed))
    results = {"output": y.detach()}
    if x.is_floating_point():
        results["input.grad"] = x.grad
    results.update({f"{name}.grad": p.grad for name, p in model.named_parameters()})
    return results


# With teacher forcing, every GEMM result the reference uses is the compiled one, checked to be
# within ``gemm_bound`` of the float64 product, and every quantizer therefore sees the
# same bits on both sides. What is left between an aot_eager run and the eager reference is the
# order in which fp32 additions combine gradient contributions (eager autograd vs the traced
# backward: at most a few terms here). We allow 16 units of fp32 roundoff of the tensor's largest
# element for that; any quantization difference is at least an FP8 / FP4 step (2^-4 relative).
ORDER_SLACK = 16 * EPS32

# Inductor fuses the non-GEMM code (RMSNorm, softmax, SiLU, bias adds and the traceable
# quantizers) and orders its fp32 reductions differently; the custom GEMM runs as is. A
# quantizer maps inputs that differ by fp32 roundoff to the same codes (unless they straddle a
# rounding boundary, ~1e-6 per element for these random-valued activations), so Inductor's
# results differ from aot_eager's only by reordered fp32 sums: reductions of up to 64 tokens,
# 64 * 2^-24 of their sum of magnitudes, which we bound by 4 times the largest |value|:
# 2^-16 of the tensor's largest element. A quantization difference (one FP8 step in one element
# of one operand) moves a result by about 2^-4 |a||b|, far above that.
INDUCTOR_SLACK = 2.0**-16


def assert_same_results(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], slack: float = ORDER_SLACK, what: str = "") -> None:
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    for key in expected:
        a, e = actual[key], expected[key]
        assert a is not None and e is not None, f"{what}{key}: a gradient is missing ({a is None}, {e is None})"
        assert a.shape == e.shape and a.dtype == e.dtype, f"{what}{key}: {a.shape}/{a.dtype} vs {e.shape}/{e.dtype}"
        allowed = slack * e.abs().max().item()
        diff = (a.double() - e.double()).abs()
        assert diff.max().item() <= allowed, (
            f"{what}{key}: {int((diff > allowed).sum())} of {e.numel()} elements differ by more than {allowed:.3g}; "
            f"max difference {diff.max().item():.3g} (largest |value| {e.abs().max().item():.3g})"
        )


def accumulation_tolerance(log: list) -> float:
    """The sum, over every GEMM the reference ran (forward and backward), of the largest fp32
    accumulation bound (``gemm_bound``) among its outputs: how far fp32 runs of the same
    computation may drift apart when no quantizer re-synchronizes them (see
    test_compile_identity)."""
    return sum(entry[4] for entry in log)


# -- pytest --------------------------------------------------------------------------------------

import pytest


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: Dynamo's per-code-object cache would otherwise fill up
    (recompile_limit) across tests that compile the same model classes, and fall back to eager."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class StaticInputs:
    """A backend (``.backend``) that runs AOTAutograd's graphs eagerly and records, at every call
    of a forward graph, the addresses of its inputs (``given``) and of those AOT calls static
    (``static``: CUDA graph trees read them in place rather than copy them at each replay)."""

    def __init__(self) -> None:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.given: set[int] = set()
        self.static: set[int] = set()
        self.backend = aot_autograd(fw_compiler=self._compiler, bw_compiler=lambda graph, inputs: make_boxed_func(graph))

    def clear(self) -> None:
        self.given.clear()
        self.static.clear()

    def _compiler(self, graph, inputs):
        from torch._guards import TracingContext

        indices = TracingContext.get().fw_metadata.static_input_indices

        def run(args):
            self.given.update(a.data_ptr() for a in args if isinstance(a, torch.Tensor))
            self.static.update(args[i].data_ptr() for i in indices)
            return graph(*args)

        run._boxed_call = True
        return run


def cuda_graph_replays(fn: Callable[[torch.Tensor], Any], x: torch.Tensor, scales=(1.0, 1e-3, 1e3)):
    """``fn(x)`` captured in a CUDA graph (called once before, outside the capture: Triton
    compiles and tunes there); for each of ``scales``, x refilled with new values times it and the
    graph replayed: yields (the scale, what the replay wrote)."""
    fn(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fn(x)
    for scale in scales:
        x.copy_(torch.randn_like(x) * scale)
        graph.replay()
        yield scale, replayed


def cuda_graph_of(step: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``step()`` captured in a CUDA graph after one call on a side stream (a capture's warm-up),
    and what the captured call returned: the tensors each replay writes."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def emulated_stand_in(rows: list[int]) -> Callable:
    """A stand-in, on this CPU, for the decode GEMM's ``gemm(a, b, out_dtype, bias)``: the emulated
    product, each call's rows of A added to ``rows``."""
    from graphquant.kernels import emulation

    def stand_in(a, b, out_dtype, bias=None):
        rows.append(a.shape[0])
        return emulation.gemm(a, b, 1, out_dtype, bias)[0]

    return stand_in


def mixed_input_stand_in(rows: list[int], stored: Optional[list[bool]] = None, launches: Optional[list[int]] = None) -> Callable:
    """A stand-in, on this CPU, for the mixed-input GEMM's ``multiply(values, a_amax, bs, out_dtype,
    biases, stored_weight=...)``: the kernel's numerics (x's values put back in K order, fp32 sums,
    NVFP4's alpha, the bias, one rounding) for each B, each launch's rows of A added to ``rows``,
    whether it was told its B's are stored to ``stored`` and how many B's it multiplies to
    ``launches``."""
    from graphquant.formats import nvfp4
    from graphquant.kernels import mixed_input

    def product(x, a_amax, b, out_dtype, bias):
        product = x.float() @ b.quantizer.emulated_values(b).float().t()
        if a_amax is not None:
            product = product * (nvfp4.global_decode(a_amax) * nvfp4.global_decode(b.amax))
        if bias is not None:
            product = product + bias.float()
        return product.to(out_dtype)

    def stand_in(values, a_amax, bs, out_dtype, biases=None, stored_weight=False):
        rows.append(values.shape[0])
        for record, value in ((stored, stored_weight), (launches, len(bs))):
            if record is not None:
                record.append(value)
        family = bs[0].quantizer.gemm_input(bs[0].direction).family
        k = values.shape[1]
        where = mixed_input.atoms_permuted(torch.arange(k).reshape(1, k), family)[0]  # the source K of each position
        x = torch.empty_like(values)
        x[:, where] = values
        return [product(x, a_amax, b, out_dtype, bias) for b, bias in zip(bs, biases or [None] * len(bs), strict=True)]

    return stand_in


class DecodeCalls(list):
    """The A operand of each GEMM the faked decode GEMM ran (``hopper_on_cpu``), in order, and in
    ``launches`` how many GEMMs each of its launches ran (several where they read one A)."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: list[int] = []


@pytest.fixture
def hopper_on_cpu(monkeypatch):
    """A faked Hopper whose decode GEMM, on this CPU, quantizes A by the reference where it is to
    quantize it and multiplies on the emulated GEMM, as its cuBLASLt GEMMs do (the CPU's
    torch._scaled_mm takes other layouts); gives the decode GEMM's calls (DecodeCalls)."""
    from graphquant.kernels import backends, emulation, scaled_mm

    triton_decode = backends.triton_decode
    if triton_decode is None:
        pytest.skip("no Triton: no decode GEMM")
    got = DecodeCalls()

    def stand_in(a, b, out_dtype, bias=None):
        return shared(a, [b], out_dtype, [bias])[0]

    def shared(a, bs, out_dtype, biases):
        got.extend([a] * len(bs))
        got.launches.append(len(bs))
        if isinstance(a, triton_decode.QuantizedOnLoad):
            a = a.quantizer(a.data, columnwise=False).get(ROWWISE)
        return [emulation.gemm(a, b, 1, out_dtype, bias)[0] for b, bias in zip(bs, biases)]

    monkeypatch.setattr(backends, "capability", lambda device: (9, 0))
    monkeypatch.setattr(triton_decode, "gemm", stand_in)
    monkeypatch.setattr(triton_decode, "gemms_sharing_a", shared)
    monkeypatch.setattr(scaled_mm, "run", lambda backend, a, b, out_dtype, bias=None: emulation.gemm(a, b, 1, out_dtype, bias)[0])
    backends.clear_caches()
    yield got
    backends.clear_caches()
