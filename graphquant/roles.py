"""QuantizerRole: which slot a quantizer serves (the owning module's kind, the tensor, the module)."""

from __future__ import annotations

import dataclasses
import re

# Attention's hint-only boundary roles, named <name>.dpa_output and <name>.dpa_grad_input.
HINTS = ("dpa_output", "dpa_grad_input")


@dataclasses.dataclass(frozen=True)
class QuantizerRole:
    """A slot's identity, handed to the recipe's factory.

    Empty fields mean "no signal", not "no role". Treat the strings as selectors that may grow:
    dispatch on ``module_type`` first, refine by ``tensor_type``, and end a factory with a total
    default.

    module_type: ``"linear"``, ``"grouped_linear"``, ``"matmul"``, or ``"dpa"`` (attention, asked
        for only under ``CustomRecipe(fp8_dpa=True)``).
    tensor_type: ``"input"``, ``"weight"``, ``"grad_output"`` for linears; ``"input"``, ``"other"``,
        ``"grad_output"`` for matmuls; ``"qkv"``, ``"s"``, ``"do"``, ``"dp"`` for attention.
        Attention's hint-only boundary roles leave module_type and tensor_type empty and are
        named ``<name>.dpa_output`` and ``<name>.dpa_grad_input``.
    name: the owner's fully qualified name as ``model.named_modules()`` spells it.
    """

    module_type: str = ""
    tensor_type: str = ""
    name: str = ""

    def __str__(self) -> str:
        fields = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self) if getattr(self, f.name)]
        return "|".join(fields) if fields else "QuantizerRole()"

    @classmethod
    def parse(cls, text: str) -> "QuantizerRole":
        """The role whose ``str`` is ``text`` ("module_type=linear|tensor_type=input|name=fc1");
        ValueError where it is no such string."""
        if text == str(cls()):
            return cls()
        # The fields in their order; a module name (last) may hold '|' or '=' itself.
        match = re.fullmatch(r"(?:module_type=([^|=]+))?(?:(?<!^)\|)?(?:tensor_type=([^|=]+))?(?:(?<!^)\|)?(?:name=(.+))?", text)
        if match is None or not any(match.groups()) or str(cls(*(g or "" for g in match.groups()))) != text:
            raise ValueError(f"{text!r} is no QuantizerRole string (module_type=...|tensor_type=...|name=..., the empty ones left out)")
        return cls(*(g or "" for g in match.groups()))

    @property
    def hint(self) -> str:
        """Which of attention's hint-only boundary roles this is (HINTS), or ""."""
        last = self.name.rpartition(".")[2]
        return last if not self.module_type and last in HINTS else ""

    @property
    def owner(self) -> str:
        """The module whose slot this is: the name, without a hint role's suffix (attention's, as
        its dpa roles name it)."""
        return self.name.rpartition(".")[0] if self.hint else self.name

    @property
    def backward(self) -> bool:
        """Whether the slot's tensor is a gradient (grad_output, do, dp, the dpa_grad_input hint),
        which a delayed-scaling request under the HYBRID format gives E5M2."""
        return self.tensor_type in ("grad_output", "do", "dp") or self.hint == "dpa_grad_input"
