"""Small models for the explain, dump, numerics and command-line tests (plain torch; one quantizer
for the command line to be given where it asks for a recipe).

Kept apart from other test models because golden tests pin their graphs: changing one here
changes those goldens. Sizes are multiples of 32 so every format tiles every operand.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphquant import MXFP8Quantizer


class MLP(nn.Module):
    """fc1 -> relu -> fc2: two linear sites."""

    def __init__(self, d_in: int = 64, hidden: int = 128, d_out: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class TinyAttention(nn.Module):
    """One head of attention with explicit matmuls: a qkv linear and two matmul sites."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.scale = dim**-0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(-2, -1) * self.scale, dim=-1)
        return weights @ v


def mlp() -> MLP:
    """A model factory for the command line: MODULE:mlp."""
    torch.manual_seed(0)
    return MLP()


def attention_with_inputs() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A model factory that brings its example inputs: MODULE:attention_with_inputs."""
    torch.manual_seed(0)
    return TinyAttention(), (torch.randn(2, 32, 32),)


MODEL = MLP()  # a model object for the command line: MODULE:MODEL


class WithOutputs(MLP):
    """An MLP that returns a dict of its output and a second tensor, as transformers' models return
    a ModelOutput: the command line's numerics differentiates the sum of both."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = super().forward(x)
        return {"logits": y, "doubled": 2 * y}


def with_outputs() -> WithOutputs:
    """MODULE:with_outputs."""
    torch.manual_seed(0)
    return WithOutputs()


NOT_A_MODEL = 3
A_QUANTIZER = MXFP8Quantizer()  # a quantizer named where a recipe is asked for


def not_a_model():
    return 3
