"""graphquant.freeze: an inference model whose linears keep their weights only quantized.

A model compiled with mode="inference" quantizes each weight at each call, so that no write to a
weight is missed (graphquant.ops.inference). Once its weights are final, ``freeze`` quantizes each
nn.Linear's weight once, as the inference GEMM reads it (rowwise, with the recipe's weight
quantizer: the bits the per-call path computes), and puts a FrozenLinear that keeps only that in
the linear's place. The frozen model's state_dict is the quantized weights; ``freeze(model,
state_dict=...)`` builds a frozen model from one without quantizing anything.
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping, Optional

import torch
from torch import nn

from graphquant import distributed, user_stack
from graphquant.compiler import GraphquantBackend
from graphquant.ops import frozen  # noqa: F401  (registers graphquant::frozen_linear)
from graphquant.ops.inference import frozen_weight
from graphquant.quantizers import ROWWISE, QuantizeContext, Quantizer
from graphquant.roles import QuantizerRole

# The stored parts of the weight's rowwise representation (Representation.tensors' order).
PARTS = ("codes", "scale", "amax")


class FrozenLinear(nn.Module):
    """An nn.Linear whose weight is stored as the rowwise representation its inference GEMM reads,
    in the buffers ``weight_codes``, ``weight_scale`` and ``weight_amax`` (empty where the format
    has no such part), with no high-precision weight; the bias stays as it was.

    It runs only inside the graphquant-compiled model it was frozen in, which reads the stored
    weight in place of quantizing one. Its state_dict carries the weight's format, logical shape and
    dtype as extra state: a checkpoint loads only into a FrozenLinear of the same ones.
    """

    def __init__(
        self, name: str, weight_format: str, shape: tuple[int, int], dtype: torch.dtype, tensors: list[torch.Tensor], bias: Optional[torch.Tensor]
    ) -> None:
        super().__init__()
        self.name = name  # the nn.Linear's qualified name, the site's name in plans and errors
        self.weight_format = weight_format
        self.out_features, self.in_features = shape
        self.weight_dtype = dtype
        for part, tensor in zip(PARTS, tensors):
            self.register_buffer(f"weight_{part}", tensor.contiguous())
        self.register_parameter("bias", bias)

    @classmethod
    def quantized(cls, name: str, linear: nn.Linear, quantizer: Quantizer, amax_group: Optional[str]) -> "FrozenLinear":
        """``linear`` with its weight quantized now, by the function the per-call inference path uses."""
        weight = frozen_weight(linear.weight, quantizer, amax_group)
        tensors = [t.detach().clone() for t in weight.tensors]  # an IdentityQuantizer's codes are the weight itself
        return cls(name, weight.spec, weight.shape, linear.weight.dtype, tensors, linear.bias)

    @classmethod
    def unfilled(cls, name: str, linear: nn.Linear, quantizer: Quantizer) -> "FrozenLinear":
        """``linear`` with room for its stored weight, to be loaded from a checkpoint: the layout is
        that of the format's rowwise representation of a meta tensor (shapes and dtypes, no values)."""
        rowwise = quantizer.child(ROWWISE)
        meta = torch.empty(linear.weight.shape, dtype=linear.weight.dtype, device="meta")
        layout = rowwise.quantize_rowwise(meta, QuantizeContext()).tensors()
        tensors = [torch.empty(t.shape, dtype=t.dtype, device=linear.weight.device) for t in layout]
        return cls(name, rowwise.spec, tuple(linear.weight.shape), linear.weight.dtype, tensors, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = [self.weight_codes, self.weight_scale, self.weight_amax]
        shape = [self.out_features, self.in_features]
        return torch.ops.graphquant.frozen_linear.default(x, weight, self.weight_format, shape, self.weight_dtype, self.bias, self.name)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, weight={self.weight_format}"

    def get_extra_state(self) -> dict[str, Any]:
        return {"format": self.weight_format, "shape": [self.out_features, self.in_features], "dtype": str(self.weight_dtype)}

    def set_extra_state(self, state: Any) -> None:
        """Nothing to set: ``_load_from_state_dict`` checked the state against this module's own
        before it copied any tensor."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        """Refuse a checkpoint whose weight is not this one's format, shape and layout, naming what
        differs: a tensor of another dtype would otherwise be converted silently."""
        error = self._mismatch(state_dict, prefix)
        if error:
            error_msgs.append(f"graphquant: {self.name} is frozen as {self.weight_format} of a {self.weight_dtype} weight "
                              f"of shape ({self.out_features}, {self.in_features}); {error}")
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def _mismatch(self, state_dict: Mapping[str, Any], prefix: str) -> str:
        """What in ``state_dict`` differs from this module's stored weight ("" if nothing)."""
        if prefix + "weight" in state_dict:
            return (f"the checkpoint holds a high-precision {prefix}weight instead: load it into the model before "
                    "graphquant.freeze, or save the frozen model's state_dict")
        saved = state_dict.get(prefix + "_extra_state")
        if saved is not None and saved != self.get_extra_state():
            return (f"the checkpoint's {prefix[:-1]} is {saved.get('format')} of a {saved.get('dtype')} weight of shape "
                    f"{tuple(saved.get('shape', ()))}: load a checkpoint of this model frozen under this recipe")
        for part in PARTS:
            key, mine = prefix + "weight_" + part, getattr(self, "weight_" + part)
            theirs = state_dict.get(key)
            if isinstance(theirs, torch.Tensor) and (theirs.shape != mine.shape or theirs.dtype != mine.dtype):
                return (f"the checkpoint's {key} is {theirs.dtype} of shape {tuple(theirs.shape)}, where the format "
                        f"stores {mine.dtype} of shape {tuple(mine.shape)}")
        return ""


def freeze(model: nn.Module, state_dict: Optional[Mapping[str, torch.Tensor]] = None) -> nn.Module:
    """Replace, in place, every nn.Linear of ``model`` (what ``graphquant.compile(...,
    mode="inference")`` returned) by a FrozenLinear that stores its weight quantized and drops the
    high-precision one; returns ``model``, which then runs from the stored weights.

    Without ``state_dict``, each weight is quantized now: rowwise with the recipe's weight quantizer,
    the bits the per-call inference path computes. With ``state_dict`` (a frozen model's, as
    ``torch.load(path, weights_only=True)`` gives it back), nothing is quantized: the weights and
    every other tensor are loaded from it, keys with or without torch.compile's ``_orig_mod.``
    prefix. A model built on the meta device takes the checkpoint's tensors themselves.

    A linear whose weight is tied to another module's (a tied LM head) keeps it, with a warning.
    """
    backend = model.__dict__.get("graphquant") if isinstance(model, nn.Module) else None
    if not isinstance(backend, GraphquantBackend) or backend.root is None:
        raise TypeError(f"graphquant.freeze takes the module graphquant.compile(model, recipe, mode='inference') returned, "
                        f"got {type(model).__name__}")
    if backend.mode != "inference":
        raise ValueError(f"graphquant.freeze needs a model compiled with mode='inference' (this one: mode={backend.mode!r}): "
                         "a frozen model has no backward; compile it with graphquant.compile(model, recipe, mode='inference')")
    root = backend.root
    amax_group = distributed.group_name(backend.planner.recipe.amax_reduction_group)
    tied = _tied_parameters(root)
    linears = [(name, m) for name, m in root.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        user_stack.warn(f"graphquant.freeze found no nn.Linear in {type(root).__name__}: nothing was frozen")
    for name, linear in linears:
        if id(linear.weight) in tied:
            others = [other for other in tied[id(linear.weight)] if other != f"{name}.weight"]
            user_stack.warn(f"graphquant.freeze leaves {name} with its high-precision weight: it is tied to "
                            f"{', '.join(others)}, which needs it")
            continue
        quantizer = backend.planner.quantizer(QuantizerRole("linear", "weight", name))
        _check_freezable(name, quantizer)
        if state_dict is None and linear.weight.is_meta:
            raise ValueError(f"graphquant.freeze: {name}'s weight is on the meta device, with no values to quantize; pass "
                             "the frozen checkpoint to load as graphquant.freeze(model, state_dict=...)")
        if state_dict is None:
            root.set_submodule(name, FrozenLinear.quantized(name, linear, quantizer, amax_group))
        else:
            root.set_submodule(name, FrozenLinear.unfilled(name, linear, quantizer))
    if state_dict is not None:
        state = dict(state_dict)
        torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state, "_orig_mod.")
        root.load_state_dict(state, assign=any(t.is_meta for t in itertools.chain(root.parameters(), root.buffers())))
    return model


def _check_freezable(name: str, quantizer: Quantizer) -> None:
    """A stored weight stands for every later call only where quantizing it needs no state."""
    rowwise = quantizer.child(ROWWISE)
    if rowwise.keeps_state or rowwise.stochastic:
        why = "keeps a scale that changes every call (delayed scaling)" if rowwise.keeps_state else "rounds stochastically, a new draw every call"
        raise ValueError(
            f"graphquant.freeze: {name}'s weight format {rowwise} {why}, so no single stored quantized weight "
            "equals what later calls would compute; give the weight a stateless quantizer in the recipe's factory "
            "(current scaling, rowwise, blockwise, MXFP8, NVFP4 without stochastic rounding)"
        )


def _tied_parameters(root: nn.Module) -> dict[int, list[str]]:
    """id of each parameter shared by several names -> those names."""
    names: dict[int, list[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {key: value for key, value in names.items() if len(value) > 1}
