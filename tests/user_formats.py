"""Formats of a user's own that keep their codes in bf16 (no FP8 dtype), shared by the tests of
the user-format contract and of graphquant.numerics."""

import dataclasses

import torch

from graphquant.quantizers import COLUMNWISE, ROWWISE, Quantizer


@dataclasses.dataclass(frozen=True)
class Bf16Codes(Quantizer):
    """Codes in bf16 times a float32 scale, both from ``_codes``, the same in either direction."""

    tag = "test_bf16_codes"

    def _codes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.to(torch.bfloat16), torch.tensor(1.0)

    def _encode(self, x, direction):
        codes, scale = self._codes(x)
        return self.representation(direction, x.shape, x.dtype, codes, scale)

    def quantize_rowwise(self, x, ctx):
        return self._encode(x, ROWWISE)

    def quantize_columnwise(self, x, ctx):
        return self._encode(x, COLUMNWISE)

    def dequantize(self, rep):
        return rep.data.float() * rep.scale


@dataclasses.dataclass(frozen=True)
class Clipped(Bf16Codes):
    """x clipped at ``clip`` (inf: not at all), in bf16; ``levels`` (empty: any) is only carried."""

    tag = "test_clipped"

    clip: float = 1.0
    levels: tuple = ()

    def _codes(self, x):
        return x.clamp(-self.clip, self.clip).to(torch.bfloat16), torch.tensor(1.0)
