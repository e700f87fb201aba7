"""Where graphquant.numerics listens: each GEMM, after it ran, as one RecordedGemm.

A GEMM runs exactly as it does unobserved; only its high-precision operands stay referenced
until its backward while a recorder listens. Only eager execution reports real tensors, so
numerics runs the rewritten graph eagerly. Inactive, a GEMM pays one global read.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator, Optional

import torch

from graphquant.ops.operands import Operand
from graphquant.ops.site import Site


@dataclasses.dataclass(frozen=True)
class Grouping:
    """What a grouped (expert) GEMM adds: its operands lie in graphquant.formats.groups' padded
    layout (so do a and b, zeros between the groups), each padded row's group, how many values a
    and b hold without that padding, and the same product of the high-precision operands, which
    only the grouped op knows how to take."""

    a_group: torch.Tensor
    b_group: torch.Tensor
    values: tuple[int, int]
    high_precision: torch.Tensor


@dataclasses.dataclass(frozen=True)
class RecordedGemm:
    """One GEMM as it ran: the high-precision 2-D tensors that entered the quantizers (a, b), the
    Operands the GEMM read, the bias it added (fprop of a biased linear) and its result; for a
    grouped GEMM, its Grouping."""

    site: Site
    gemm: str  # "fprop", "dgrad" or "wgrad"
    batch: int  # groups of the product: out[g] = a[g] @ b[g]^T
    a: torch.Tensor
    a_operand: Operand
    b: torch.Tensor
    b_operand: Operand
    bias: Optional[torch.Tensor]
    out: torch.Tensor
    grouping: Optional[Grouping] = None


_recorder: Optional[Callable[[RecordedGemm], None]] = None


@contextlib.contextmanager
def recording(recorder: Callable[[RecordedGemm], None]) -> Iterator[None]:
    """Call ``recorder`` with every GEMM that runs inside the block."""
    global _recorder
    previous, _recorder = _recorder, recorder
    try:
        yield
    finally:
        _recorder = previous


def listening() -> bool:
    return _recorder is not None


def record(
    site: Site, gemm: str, batch: int, a, a_operand: Operand, b, b_operand: Operand, bias, out: torch.Tensor,
    grouping: Optional[Grouping] = None,
) -> None:
    """Give the recorder, if one listens, a GEMM that ran; a or b None (not kept: the recorder
    started listening between forward and backward) reports nothing."""
    if _recorder is not None and a is not None and b is not None:
        _recorder(RecordedGemm(site, gemm, batch, a, a_operand, b, b_operand, bias, out, grouping))
