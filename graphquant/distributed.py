"""The amax all-reduce of per-tensor scaling across processes, eager and inside compiled graphs.

A recipe names the process group (CustomRecipe(amax_reduction_group=...)); graphquant.compile
writes its name into every quantized GEMM call of the graph, and a quantizer that asks for the
reduction (Float8CurrentScalingQuantizer or NVFP4Quantizer with with_amax_reduction=True,
delayed scaling with reduce_amax) takes the MAX of its amax over that group before it computes a
scale. The reduction is a functional collective: torch.compile traces it into the graph like any
op, or, for a format that a graphquant::quantize call makes (NVFP4), the op runs it.
"""

from __future__ import annotations

from typing import Optional

import torch


def group_name(group: object) -> Optional[str]:
    """The name functional collectives know ``group`` by (a ProcessGroup, or a name already)."""
    if group is None or isinstance(group, str):
        return group
    from torch.distributed import GroupMember

    if group is GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            "amax_reduction_group: this rank is not a member of the group (torch.distributed.new_group gives the ranks "
            "outside it a placeholder); give each rank a recipe whose group it belongs to, or no group"
        )
    name = getattr(group, "group_name", None)
    if not isinstance(name, str):
        raise TypeError(f"amax_reduction_group must be a torch.distributed ProcessGroup or its name, got {type(group).__name__}")
    return name


def all_reduce_amax(amax: torch.Tensor, group: str) -> torch.Tensor:
    """MAX of ``amax`` over the process group named ``group``; every rank gets the same value."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(amax, "max", group))
