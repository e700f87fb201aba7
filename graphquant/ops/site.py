"""Site: what the rewritten graph tells one GEMM call about itself, as one frozen value.

The rewrite pass builds a Site for every GEMM and passes it to the function the graph calls
(graphquant.ops.functional): the plan's decisions travel with the graph. A Site prints as the
call that rebuilds it, and FX writes that call into the graph's code, so a graph dump shows each
GEMM's formats by role and the backend each of its fprop, dgrad and wgrad runs on.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.fx

from graphquant.formats.groups import GROUP_ROWS
from graphquant.kernels.backends import GemmBackend
from graphquant.ops.library import quantizer_of
from graphquant.ops.quantize import SlotState
from graphquant.quantizers import Quantizer


def rebuilding_repr(value: object) -> str:
    """The call that rebuilds the dataclass ``value``, fields at their defaults left out."""
    given = [f for f in dataclasses.fields(value) if f.default is dataclasses.MISSING or getattr(value, f.name) != f.default]
    return f"{type(value).__name__}({', '.join(f'{f.name}={getattr(value, f.name)!r}' for f in given)})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Site:
    """One GEMM call: its owner, the format of each operand by role, and how it runs.

    The second operand's format comes as ``weight`` (a linear's: a parameter, whose copies
    backward recomputes rather than keeps) or as ``other`` (a matmul's right operand), as the
    site's roles name it. streams: the stochastic-rounding streams of x, w and grad_output.
    fprop, dgrad, wgrad: the backend the plan chose for each GEMM; dgrad and wgrad are None where
    the plan has none (a graph that never runs backward).
    inference: the graph never runs backward, so a linear (ops.inference) or an expert stack
    (ops.grouped) runs fprop alone.
    token_rows: the rows an expert stack pads each group of few tokens to a multiple of
    (the plan's GemmPlan.token_rows, from kernels.backends.token_rows; more than
    groups.FEW_TOKENS_AN_EXPERT an expert take GROUP_ROWS).
    records_amax_only: the delayed-scaling slots (by role: "input", "weight" or "other",
    "grad_output") whose step another call of this graph ends (``SlotState.ends_step``).
    """

    name: str
    call: int
    input: str
    weight: Optional[str] = None
    other: Optional[str] = None
    grad_output: str
    streams: tuple[int, int, int]
    amax_group: Optional[str] = None  # the process group of amax reductions (graphquant.distributed)
    fprop: GemmBackend
    dgrad: Optional[GemmBackend] = None
    wgrad: Optional[GemmBackend] = None
    inference: bool = False
    token_rows: int = GROUP_ROWS
    records_amax_only: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.weight is None) == (self.other is None):
            raise ValueError(
                f"GEMM site {self.label}: give the second operand's format as weight= (a linear's) or other= "
                f"(a matmul's), exactly one; got weight={self.weight!r}, other={self.other!r}"
            )

    def __repr__(self) -> str:
        return rebuilding_repr(self)

    @property
    def label(self) -> str:
        return f"{self.name}#{self.call}"

    @property
    def quantizers(self) -> tuple[Quantizer, Quantizer, Quantizer]:
        """The quantizers of x, w (weight or other) and grad_output."""
        w = self.weight if self.weight is not None else self.other
        return quantizer_of(self.input), quantizer_of(w), quantizer_of(self.grad_output)

    def slot_state(self, slot: int, delayed: Optional[torch.Tensor], rng: Optional[torch.Tensor] = None) -> SlotState:
        """The state of slot ``slot`` (0 x, 1 w, 2 grad_output) as this call reads and updates it."""
        role = ("input", "weight" if self.weight is not None else "other", "grad_output")[slot]
        return SlotState(delayed, rng, self.streams[slot], self.amax_group, ends_step=role not in self.records_amax_only)

    def runs(self, gemm: str) -> tuple[GemmBackend, str]:
        """(the backend the plan chose for ``gemm`` ("fprop", "dgrad", "wgrad"), the GEMM's name in
        errors): what graphquant.ops.operands.gemm takes after its operands."""
        backend = getattr(self, gemm)
        if backend is None:
            raise RuntimeError(f"GEMM site {self.label} has no {gemm} backend: its graph was planned without backward")
        return backend, f"{self.label} {gemm}"


# FX writes an argument it has no rule for as its repr, so the names the repr uses must be in the
# globals of every graph's code. FX's registry for such names is private: the dump and compile
# tests guard it.
torch.fx.graph._register_custom_builtin("Site", f"from {__name__} import Site", Site)
torch.fx.graph._register_custom_builtin("GemmBackend", f"from {GemmBackend.__module__} import GemmBackend", GemmBackend)
