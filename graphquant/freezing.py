"""graphquant.freeze: an inference model whose linears and expert stacks keep their weights only quantized.

A model compiled with mode="inference" quantizes each weight at each call, so that no write to a
weight is missed (graphquant.ops.inference). Once its weights are final, ``freeze`` quantizes each
nn.Linear's weight once, as the inference GEMM reads it (rowwise, with the recipe's weight
quantizer: the bits the per-call path computes), and puts a FrozenLinear that keeps only that in
the linear's place; an expert stack that torch._grouped_mm reads (a 3-D parameter) gets a
FrozenExperts beside it and a stand-in in its place. The frozen model's state_dict is the
quantized weights; ``freeze(model, state_dict=...)`` builds a frozen model from one without
quantizing anything.
"""

from __future__ import annotations

import itertools
import json
import reprlib
from typing import Any, Mapping, Optional

import torch
from torch import nn

from graphquant import distributed, user_stack
from graphquant.compiler import GraphquantBackend
from graphquant.ops.frozen import STORED_PARTS as PARTS  # importing it registers graphquant::frozen_linear
from graphquant.ops.grouped import frozen_expert_stack, stored_stack_layout
from graphquant.ops.inference import frozen_weight
from graphquant.ops.library import quantizer_of
from graphquant.passes.expert_weights import FrozenStack, UnfreezableStack
from graphquant.passes.find_gemms import without_compile_wrappers
from graphquant.passes.plan import EMPTY_PRODUCT
from graphquant.quantizers import ROWWISE, IdentityQuantizer, QuantizeContext, Quantizer
from graphquant.roles import QuantizerRole


class StoredWeight(nn.Module):
    """A weight stored as the rowwise representation its inference GEMM reads, in the buffers
    ``weight_codes``, ``weight_scale`` and ``weight_amax`` (empty where the format has no such
    part), with no high-precision copy. Its state_dict carries the format, the logical shape and
    the dtype as extra state (their JSON's bytes, a tensor: safetensors and transformers'
    save_pretrained take tensors alone): a checkpoint loads only into a stored weight of the same
    ones."""

    def __init__(self, name: str, weight_format: str, shape: tuple[int, ...], dtype: torch.dtype, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.name = name  # its qualified name, which errors give
        self.weight_format = weight_format
        self.weight_shape = tuple(shape)
        self.weight_dtype = dtype
        for part, tensor in zip(PARTS, tensors):
            self.register_buffer(f"weight_{part}", tensor.contiguous())

    def stored(self) -> list[torch.Tensor]:
        return [getattr(self, f"weight_{part}") for part in PARTS]

    def _apply(self, fn, recurse=True):
        """Module.to, .half, .cuda move a stored weight but never cast it: its parts' dtypes are
        its format's (a cast would make FP8 codes four times larger, or round fp32 scales to fp16).
        A cast changes the dtype the weight stands for, which its products come out in, as a
        high-precision weight's cast would."""
        # IdentityQuantizer()'s codes are the weight's values: they take the cast as a weight would
        # (IdentityQuantizer(dtype=...)'s keep their dtype, as a quantized format's do).
        format_ = quantizer_of(self.weight_format)
        values = format_.high_precision and getattr(format_, "dtype", None) is None
        kept = {f"weight_{part}": getattr(self, f"weight_{part}") for part in PARTS if not (values and part == "codes")}
        self.weight_dtype = fn(torch.empty(0, dtype=self.weight_dtype)).dtype
        super()._apply(fn, recurse)
        for name, before in kept.items():
            if self._buffers[name].dtype != before.dtype:
                self._buffers[name] = before.to(self._buffers[name].device)
        return self

    def description(self) -> dict[str, Any]:
        """What the extra state says: the format, the logical shape and the dtype."""
        return {"format": self.weight_format, "shape": list(self.weight_shape), "dtype": str(self.weight_dtype)}

    def get_extra_state(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(json.dumps(self.description(), sort_keys=True).encode()), dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        """Nothing to set: ``_load_from_state_dict`` checked the state against this module's own
        before it copied any tensor."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        """Refuse a checkpoint whose weight is not this one's format, shape and layout, naming what
        differs: a tensor of another dtype would otherwise be converted silently."""
        refusal = self.refusal(state_dict, prefix)
        if refusal:
            error_msgs.append(refusal)
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def refusal(self, state_dict: Mapping[str, Any], prefix: str) -> str:
        """Why this module refuses ``state_dict``'s entries under ``prefix`` ("" where it takes them)."""
        error = self._mismatch(state_dict, prefix)
        return error and f"graphquant: {self.name} is frozen as {self.weight_format} of a {self.weight_dtype} weight of shape {self.weight_shape}; {error}"

    def _mismatch(self, state_dict: Mapping[str, Any], prefix: str) -> str:
        """What in ``state_dict`` differs from this module's stored weight ("" if nothing)."""
        if prefix + "weight" in state_dict:
            return (f"the checkpoint holds a high-precision {prefix}weight instead: load it into the model before "
                    "graphquant.freeze, or save the frozen model's state_dict")
        saved = described(state_dict.get(prefix + "_extra_state"))
        if saved is not None and saved != self.description():
            return (f"the checkpoint's {prefix[:-1]} is {saved.get('format')} of a {saved.get('dtype')} weight of shape "
                    f"{tuple(saved.get('shape', ()))}: load a checkpoint of this model frozen under this recipe")
        for part in PARTS:
            key, mine = prefix + "weight_" + part, getattr(self, "weight_" + part)
            theirs = state_dict.get(key)
            if isinstance(theirs, torch.Tensor) and (theirs.shape != mine.shape or theirs.dtype != mine.dtype):
                return (f"the checkpoint's {key} is {theirs.dtype} of shape {tuple(theirs.shape)}, where the format "
                        f"stores {mine.dtype} of shape {tuple(mine.shape)}")
        return ""


class WriteRefusing(torch.Tensor):
    """A tensor whose in-place ops (``copy_``, ``normal_``, item assignment, ``out=``, ``.data``'s
    and its views' too) and ``.data =`` raise ``refusal``: a frozen weight's stand-in, where a
    write would be lost. Ops that write no values (``requires_grad_``) run."""

    refusal: str
    _NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_"})

    @staticmethod
    def of(tensor: torch.Tensor, refusal: str) -> "WriteRefusing":
        refusing = torch.Tensor._make_subclass(WriteRefusing, tensor)
        refusing.refusal = refusal
        return refusing

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        in_place = name == "__setitem__" or (name.endswith("_") and not name.endswith("__") and name not in cls._NOT_WRITES)
        first = next(iter((*args, *kwargs.values())), None)  # nn.init's by keyword
        targets = (first if in_place else kwargs.get("out")) if func != torch.Tensor.data.__set__ else args[0]
        refusing = next((t for t in (targets if isinstance(targets, (list, tuple)) else [targets]) if isinstance(t, cls)), None)
        if refusing is not None:  # a list: torch._foreach_*_'s; a tuple: out= of several
            raise RuntimeError(refusing.refusal)
        if func == torch.Tensor.data.__get__:  # .data's writes are the stand-in's
            return args[0]
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if isinstance(first, cls) and isinstance(result, torch.Tensor) and (result._is_view() or name == "detach"):
            return cls.of(result, first.refusal)  # w[0], w.t(), w.view(-1), w.detach(): its memory
        return result

    def __deepcopy__(self, memo: dict) -> "WriteRefusing":
        return WriteRefusing.of(torch.empty_like(self.as_subclass(torch.Tensor)), self.refusal)

    def __reduce_ex__(self, protocol: int) -> Any:
        return torch.empty_like(self.as_subclass(torch.Tensor)).__reduce_ex__(protocol)  # saved as the plain meta tensor it stands for


class FrozenLinear(StoredWeight):
    """An nn.Linear whose weight is a StoredWeight; the bias stays as it was.

    It runs only inside the graphquant-compiled model it was frozen in, which reads the stored
    weight in place of quantizing one.
    """

    def __init__(
        self, name: str, weight_format: str, shape: tuple[int, int], dtype: torch.dtype, tensors: list[torch.Tensor], bias: Optional[torch.Tensor]
    ) -> None:
        super().__init__(name, weight_format, shape, dtype, tensors)
        self.out_features, self.in_features = shape
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

    @property
    def weight(self) -> torch.Tensor:
        """A stand-in of the weight's shape and dtype, which holds no values: model code that reads
        a linear's weight.dtype (T5's feed-forward casts to it) runs as before. In compiled code it
        is on the stored weight's device (``x.to(self.fc.weight.device)`` places x as before) and
        the backend refuses a graph that reads its values, naming the linear. Outside compiled code
        it is on the meta device and refuses a write (``copy_``, nn.init, ``.data.normal_()``),
        which a bare meta tensor takes silently."""
        if torch.compiler.is_compiling():
            return torch.ops.graphquant.frozen_weight_stand_in.default(self.weight_codes, list(self.weight_shape), self.weight_dtype, self.name)
        stand_in = torch.empty(self.weight_shape, dtype=self.weight_dtype, device="meta")
        return WriteRefusing.of(stand_in, self._refusal("a weight written into it"))

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "weight":  # nn.Module's own message would be "attribute 'weight' already exists"
            raise AttributeError(self._refusal("a weight given to it"))
        super().__setattr__(name, value)

    def _refusal(self, what: str) -> str:
        return (f"graphquant: {self.name} is frozen, its weight stored as {self.weight_format}: {what} would never be read; "
                "give the model its weights before graphquant.freeze, or load a frozen checkpoint (load_state_dict)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = [self.out_features, self.in_features]
        return torch.ops.graphquant.frozen_linear.default(x, self.stored(), self.weight_format, shape, self.weight_dtype, self.bias, self.name)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, weight={self.weight_format}"


class FrozenExperts(StoredWeight):
    """An expert stack (a 3-D parameter that torch._grouped_mm reads) stored as its grouped GEMM's
    rowwise representation of the stack (E, K, N) the GEMM multiplies by, which the parameter is,
    or with ``transposed`` its last two dims swapped (an (E, N, K) stack stored as nn.Linear
    stores a weight). It is a child of the parameter's module, named ``frozen_<parameter>``.

    The parameter's place holds a stand-in of its shape (``stand_in``) whose values are NaN: the
    model's code still reads it, and the compiled graph's grouped GEMMs take the stored stack in
    its place; anything else that reads it fails to compile, and eagerly gives NaN.
    """

    def __init__(
        self, name: str, parameter: str, weight_format: str, shape: tuple[int, int, int], dtype: torch.dtype, transposed: bool,
        tensors: list[torch.Tensor],
    ) -> None:
        super().__init__(name, weight_format, shape, dtype, tensors)
        self.parameter, self.transposed = parameter, transposed

    @classmethod
    def quantized(
        cls, name: str, parameter: str, weight: torch.Tensor, transposed: bool, quantizer: Quantizer, amax_group: Optional[str]
    ) -> "FrozenExperts":
        """The stack ``weight`` (the parameter) quantized now, by the function the per-call inference path uses."""
        stack = weight.transpose(1, 2) if transposed else weight
        operand = frozen_expert_stack(stack, quantizer, amax_group)
        tensors = [t.detach().clone() for t in operand.tensors]
        return cls(name, parameter, operand.spec, tuple(stack.shape), weight.dtype, transposed, tensors)

    @classmethod
    def unfilled(cls, name: str, saved: Mapping[str, Any], device: torch.device) -> "FrozenExperts":
        """Room for a stack a checkpoint holds, ``saved`` its extra state: the layout the format
        stores for the stack's shape and dtype (shapes and dtypes, no values)."""
        dtype, shape = _dtype(saved["dtype"]), tuple(saved["shape"])
        layout = stored_stack_layout(saved["format"], shape, dtype)
        tensors = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in layout]
        return cls(name, saved["parameter"], saved["format"], shape, dtype, saved["transposed"], tensors)

    def stand_in(self, stand_ins: dict[tuple, torch.Tensor]) -> torch.Tensor:
        """A tensor of the parameter's shape and dtype whose values are NaN, on the stored stack's
        device: one expert's worth of memory, shared through ``stand_ins`` by every stack of that
        shape (a zero stride across experts; torch._grouped_mm's checks need no less)."""
        experts, k, n = self.weight_shape
        rows, cols = (n, k) if self.transposed else (k, n)
        device = self.weight_codes.device
        key = (rows, cols, self.weight_dtype, device)
        if key not in stand_ins:
            stand_ins[key] = torch.full((1, rows, cols), float("nan"), dtype=self.weight_dtype, device=device)
        return stand_ins[key].expand(experts, rows, cols)

    def stack(self) -> FrozenStack:
        return FrozenStack(self.name, self.weight_format, self.weight_shape, self.weight_dtype, self.transposed)

    def description(self) -> dict[str, Any]:
        return super().description() | {"parameter": self.parameter, "transposed": self.transposed}

    def extra_repr(self) -> str:
        return f"parameter={self.parameter}, experts={self.weight_shape[0]}, k={self.weight_shape[1]}, n={self.weight_shape[2]}, transposed={self.transposed}, weight={self.weight_format}"


# Under a serving script's inference_mode the stored weights would be inference tensors, which no later load can write.
@torch.inference_mode(False)
def freeze(model: nn.Module, state_dict: Optional[Mapping[str, torch.Tensor]] = None) -> nn.Module:
    """Replace, in place, every nn.Linear of ``model`` (what ``graphquant.compile(...,
    mode="inference")`` returned) by a FrozenLinear that stores its weight quantized and drops the
    high-precision one, and every expert stack that its compiled graphs read through
    torch._grouped_mm alone by a FrozenExperts; returns ``model``, which then runs from the stored
    weights.

    Without ``state_dict``, each weight is quantized now: rowwise with the recipe's weight quantizer,
    the bits the per-call inference path computes. Expert stacks are known only from a graph that
    reads them: call the model once before. With ``state_dict`` (a frozen model's, as
    ``torch.load(path, weights_only=True)`` gives it back), nothing is quantized: the weights and
    every other tensor are loaded from it, keys with or without torch.compile's ``_orig_mod.``
    prefix. A model built on the meta device takes the checkpoint's tensors themselves. Inference
    tensors (a checkpoint loaded, or a model built, under torch.inference_mode) become ordinary
    tensors on the same memory, nothing copied, which a later load_state_dict can write. A linear
    whose high-precision weight a frozen checkpoint holds (its frozen model kept it) is kept and
    loaded so.

    A weight tied to another module's (a tied LM head) stays as it is, with a warning, as do an
    nn.Linear subclass with a forward or parameters of its own, an nn.MultiheadAttention's
    out_proj, a linear whose weight the compiled graphs read other than through its forward, and
    an expert stack that the model's graphs read other than as one grouped site's weight.
    """
    backend = model.__dict__.get("graphquant") if isinstance(model, nn.Module) else None
    if not isinstance(backend, GraphquantBackend) or backend.root is None:
        raise TypeError(f"graphquant.freeze takes the module graphquant.compile(model, recipe, mode='inference') returned, "
                        f"got {type(model).__name__}")
    if backend.mode != "inference":
        raise ValueError(f"graphquant.freeze needs a model compiled with mode='inference' (this one: mode={backend.mode!r}): "
                         "a frozen model has no backward; compile it with graphquant.compile(model, recipe, mode='inference')")
    if state_dict is not None and not isinstance(state_dict, Mapping):
        raise TypeError(f"graphquant.freeze: state_dict takes a mapping of names to tensors, a frozen model's state_dict as "
                        f"torch.load(path, weights_only=True) or safetensors.torch.load_file(path) gives it back; got "
                        f"{type(state_dict).__name__} {reprlib.repr(state_dict)}")
    root = backend.root
    amax_group = distributed.group_name(backend.planner.recipe.amax_reduction_group)
    shared = _shared_parameters(root)
    tied = {key: names for key, (names, holders) in shared.items() if holders > 1}  # other modules need these
    if state_dict is not None:
        _check_no_meta_buffer_is_left(root)
    linears, kept = [], []
    for name, m in root.named_modules():
        if isinstance(m, nn.Linear):
            why = _kept_because(name, m, backend, tied) if name else "the compiled model itself, which no FrozenLinear can take the place of (freeze a model that holds it)"
            (kept.append((name, why)) if why else linears.append((name, m)))
    stored_before = {name for name, m in root.named_modules() if isinstance(m, StoredWeight)}  # a freeze again, after model.to
    # Every weight's format and shape is checked before any is replaced: such a refusal leaves the
    # model as it was, as a checkpoint that does not fit does (_loaded).
    state = None
    if state_dict is not None:
        state = {key: _ordinary(value) if isinstance(value, torch.Tensor) else value for key, value in state_dict.items()}
        torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state, "_orig_mod.")
        _with_tied_entries(state, [names for names, _ in shared.values()])
        if _stored_weight(state) is not None:  # a frozen model's: a high-precision weight in it is one that model kept
            kept += [(name, "the frozen checkpoint holds its high-precision weight, as the frozen model kept it")
                     for name, _ in linears if f"{name}.weight" in state]
            linears = [(name, m) for name, m in linears if f"{name}.weight" not in state]
    frozen = []
    for name, linear in linears:
        quantizer = _weight_quantizer(backend, name, tuple(linear.weight.shape))
        _check_freezable(name, quantizer)
        _check_tiles(name, quantizer, tuple(linear.weight.shape))
        if state_dict is None and linear.weight.is_meta:
            raise ValueError(f"graphquant.freeze: {name}'s weight is on the meta device, with no values to quantize; pass "
                             "the frozen checkpoint to load as graphquant.freeze(model, state_dict=...)")
        frozen.append((name, linear, quantizer))
    _without_inference_tensors(root)
    if state_dict is None:
        expert_stacks = _expert_stacks(root, backend, tied)
        for name, linear, quantizer in frozen:
            _put(root, linear, FrozenLinear.quantized(name, linear, quantizer, amax_group))
        stacks = [_take_place(root, FrozenExperts.quantized(*stack, amax_group)) for stack in expert_stacks]
    else:
        stacks = _loaded(root, state, [(name, linear, FrozenLinear.unfilled(name, linear, quantizer)) for name, linear, quantizer in frozen])
    # After loading (a stack loaded onto the meta device is on the checkpoint's now), and for the
    # stacks frozen before too, whose stand-ins Module.to copies to full size.
    stand_ins: dict[tuple, torch.Tensor] = {}
    for frozen in (m for m in root.modules() if isinstance(m, FrozenExperts)):
        root.get_submodule(_owner(frozen.name)).register_buffer(frozen.parameter, frozen.stand_in(stand_ins), persistent=False)
    if (linears or stacks) and not stored_before:  # its first freeze
        root.register_load_state_dict_pre_hook(_refusing_before_loading)
    if not linears and not stacks and not stored_before:
        found = "nothing it can store" if kept or backend.expert_weights else "no nn.Linear and no expert stack read by torch._grouped_mm"
        user_stack.warn(f"graphquant.freeze found {found} in {type(root).__name__}: nothing was frozen")
    if kept:
        user_stack.warn(
            f"graphquant.freeze keeps {len(kept)} nn.Linear module(s) as they are "
            f"({'; '.join(f'{name}: {why}' for name, why in kept[:4])}{'; ...' if len(kept) > 4 else ''}): their weights stay in "
            "high precision, quantized at each call"
        )
    _warn_of_sites_left(backend, {name for name, _ in linears} | {name for name, _ in kept} | stored_before)
    return model


def _ordinary(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or, where it is an inference tensor (made under torch.inference_mode: a
    checkpoint a serving script loaded there), an ordinary tensor on its memory, nothing copied:
    torch refuses an inference tensor as a parameter outside inference mode, and a later
    load_state_dict could not write it. A frozen model runs no backward, whose version checks an
    inference tensor's writes would escape."""
    if not tensor.is_inference():
        return tensor
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return alias.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())


def _without_inference_tensors(root: nn.Module) -> None:
    """Put an ordinary tensor on the same memory (``_ordinary``) in the place of each inference
    tensor among ``root``'s parameters and buffers (a model built under torch.inference_mode),
    which a checkpoint's load could not write outside it; tied ones stay tied."""
    ordinary: dict[int, torch.Tensor] = {}
    for module in root.modules():
        for tensors in (module._parameters, module._buffers):
            for name, tensor in tensors.items():
                if tensor is not None and tensor.is_inference():
                    if id(tensor) not in ordinary:
                        alias = _ordinary(tensor)
                        ordinary[id(tensor)] = nn.Parameter(alias, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else alias
                    tensors[name] = ordinary[id(tensor)]


def _kept_because(name: str, linear: nn.Linear, backend: GraphquantBackend, tied: dict[int, list[str]]) -> str:
    """Why a FrozenLinear would not compute what ``linear`` does ("" where it would): a subclass's
    forward, parameters, buffers or submodules (a learned logit scale, a router returning a
    tuple), hooks, or a weight the compiled graphs read other than through the linear's forward,
    which would read the stored weight's stand-in: nn.MultiheadAttention's out_proj always (its
    forward reads the weight through F.multi_head_attention_forward), others once a call has
    compiled the graphs that read them."""
    own = {n for n, _ in itertools.chain(linear.named_parameters(recurse=False), linear.named_buffers(recurse=False))}
    if type(linear).forward is not nn.Linear.forward or not own <= {"weight", "bias"} or any(True for _ in linear.children()):
        return f"a {type(linear).__name__} with a forward or state of its own, which a FrozenLinear would drop"
    if linear._forward_hooks or linear._forward_pre_hooks:
        return "hooks, which a FrozenLinear would drop"
    tie = _tie(f"{name}.weight", tied, linear.weight)
    if tie:  # before the graphs' other reads of it: its twin's
        return f"its weight is {tie}"
    if isinstance(backend.root.get_submodule(_owner(name)), nn.MultiheadAttention):  # known before any graph is
        return "nn.MultiheadAttention's forward reads its weight itself, not through the linear's forward"
    if f"{name}.weight" in backend.weights_read_otherwise:
        return "its weight is read other than by its own forward"
    return ""


def _warn_of_sites_left(backend: GraphquantBackend, linears: set[str]) -> None:
    """Say which linear sites of the graphs compiled so far are no nn.Linear (transformers' Conv1D,
    an F.linear of a module's parameter), and which grouped sites read their expert stack other
    than as a parameter or its transpose (a slice of a fused stack, a cast): both keep their
    high-precision weights, quantized at each call."""
    def sites(module_type: str) -> set[str]:
        return {g.site.rpartition("#")[0] for plan in backend.plans for g in plan.gemms if g.module_type == module_type}

    left = sorted(sites("linear") - linears)
    if left:
        user_stack.warn(
            f"graphquant.freeze stores the weights of nn.Linear modules and expert stacks; {len(left)} linear site(s) of "
            f"this model are neither ({', '.join(left[:4])}{', ...' if len(left) > 4 else ''}: a transformers Conv1D, or "
            "F.linear of a parameter) and keep their high-precision weights, quantized at each call"
        )
    told = {site for read in backend.expert_weights.values() for site in read.sites}  # stored, or left with its reason
    unread = sorted(sites("grouped_linear") - told)
    if unread:
        user_stack.warn(
            f"graphquant.freeze stores an expert stack that a grouped GEMM reads as a parameter or its transpose; "
            f"{len(unread)} grouped site(s) read theirs otherwise ({', '.join(unread[:4])}{', ...' if len(unread) > 4 else ''}: "
            "a slice of a fused stack, or float32 master weights cast to bfloat16 in the forward, say), which keeps its "
            "high-precision values, quantized at each call"
        )


def _expert_stacks(root: nn.Module, backend: GraphquantBackend, tied: dict[int, list[str]]) -> list[tuple]:
    """FrozenExperts.quantized's arguments (but the amax group) for each parameter that the graphs
    compiled so far read as one grouped site's expert stack, each checked to be freezable."""
    parameters = dict(root.named_parameters())
    if not backend.plans and any(p.dim() == 3 for p in parameters.values()):
        user_stack.warn("graphquant.freeze knows expert stacks only from a compiled graph that reads them, and this model "
                        "has not been called: its 3-D parameters keep their high-precision values; call the model once "
                        "before graphquant.freeze to store them quantized too")
    stacks = []
    for name, read in sorted(backend.expert_weights.items()):
        if name not in parameters or _is_tied(name, tied, parameters[name]):
            continue
        if isinstance(read, UnfreezableStack):
            user_stack.warn(f"graphquant.freeze leaves the expert stack {name} with its high-precision values: it is {read.why}")
            continue
        quantizer = backend.planner.quantizer(QuantizerRole("grouped_linear", "weight", read.site))
        _check_freezable(name, quantizer)
        if parameters[name].is_meta:
            raise ValueError(f"graphquant.freeze: {name} is on the meta device, with no values to quantize; pass "
                             "the frozen checkpoint to load as graphquant.freeze(model, state_dict=...)")
        owner, _, attribute = name.rpartition(".")
        module_name = ".".join(p for p in (owner, f"frozen_{attribute}") if p)
        stacks.append((module_name, attribute, parameters[name], read.transposed, quantizer))
    return stacks


def _check_no_meta_buffer_is_left(root: nn.Module) -> None:
    """Refuse a model built on the meta device whose non-persistent buffers (a rotary embedding's
    inv_freq), which no checkpoint holds, would stay there and fail its first call."""
    left = [".".join(p for p in (name, buffer) if p) for name, module in root.named_modules()
            for buffer in module._non_persistent_buffers_set if getattr(module._buffers.get(buffer), "is_meta", False)]
    if left:
        raise ValueError(
            f"graphquant.freeze: {', '.join(left[:3])}{' ...' if len(left) > 3 else ''} are on the meta device and no checkpoint "
            "holds them (non-persistent buffers, which the model computes when it is built); build the model with its "
            "parameters alone on the meta device (accelerate's init_empty_weights() does so), or give these buffers their "
            "values before freezing"
        )


def described(saved: Any) -> Optional[dict[str, Any]]:
    """The description a stored weight's extra state in a checkpoint holds (None where it is none;
    checkpoints frozen before it was a tensor hold the dict itself)."""
    if isinstance(saved, dict):
        return saved
    if not (isinstance(saved, torch.Tensor) and saved.dtype == torch.uint8 and saved.dim() == 1):
        return None
    try:
        return json.loads(bytes(saved.tolist()).decode())
    except ValueError:
        return None


def _stored_weight(state: Mapping[str, Any]) -> Optional[str]:
    """The name of the first stored weight whose extra state ``state`` holds (a frozen model's
    checkpoint holds some), or None."""
    for key, value in state.items():
        name, _, entry = key.rpartition(".")
        description = described(value) if entry == "_extra_state" else None
        if isinstance(description, dict) and "format" in description:
            return name
    return None


def _saved_stacks(state: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """(module name, description) of each FrozenExperts a checkpoint holds."""
    suffix = "._extra_state"
    saved = [(key[: -len(suffix)], described(value)) for key, value in state.items() if key.endswith(suffix)]
    return [(name, description) for name, description in saved if description is not None and "parameter" in description]


def _parameter_of(root: nn.Module, name: str, saved: Mapping[str, Any]) -> nn.Parameter:
    """The parameter a checkpoint's FrozenExperts ``name`` stands for, checked against its shape."""
    owner = root.get_submodule(_owner(name))
    parameter = owner._parameters.get(saved["parameter"])
    experts, k, n = saved["shape"]
    shape = (experts, n, k) if saved["transposed"] else (experts, k, n)
    if parameter is None or tuple(parameter.shape) != shape:
        found = "no such parameter" if parameter is None else f"a parameter of shape {tuple(parameter.shape)}"
        qualified = ".".join(p for p in (_owner(name), saved["parameter"]) if p)
        raise ValueError(f"graphquant.freeze: the checkpoint stores {qualified} as an "
                         f"expert stack of shape {shape}, but the model has {found} there: load a checkpoint of this model")
    return parameter


def _loaded(root: nn.Module, state: dict[str, Any], linears: list[tuple[str, nn.Linear, "FrozenLinear"]]) -> list["FrozenExperts"]:
    """The checkpoint's stacks, put in place with ``linears``' frozen modules and loaded with
    ``state`` into ``root``. A checkpoint a frozen linear refuses is refused before anything is
    replaced, and a load that fails otherwise puts the linears and the stacks' parameters back:
    either way the model stays as it was (not frozen on empty memory)."""
    _refuse(root, state, "", [(name, module) for name, _, module in linears])
    taken: list[tuple[nn.Module, str, nn.Parameter, str]] = []
    try:
        for _, linear, module in linears:
            _put(root, linear, module)
        stacks = []
        for name, saved in _saved_stacks(state):
            parameter = _parameter_of(root, name, saved)
            stacks.append(_take_place(root, FrozenExperts.unfilled(name, saved, parameter.device)))
            taken.append((root.get_submodule(_owner(name)), saved["parameter"], parameter, name.rpartition(".")[2]))
        root.load_state_dict(state, assign=any(t.is_meta for t in itertools.chain(root.parameters(), root.buffers())))
    except Exception:
        for _, linear, module in linears:
            _put(root, module, linear)
        for owner, parameter_name, parameter, added in taken:
            delattr(owner, added)
            owner.register_parameter(parameter_name, parameter)
        raise
    return stacks


def _refuse(root: nn.Module, state: Mapping[str, Any], prefix: str, stored: list[tuple[str, StoredWeight]]) -> None:
    """Raise, naming every refusal, where a stored weight of ``stored`` refuses its entries in
    ``state`` (``root``'s, under ``prefix``)."""
    refusals = [refusal for name, module in stored if (refusal := module.refusal(state, f"{prefix}{name}."))]
    if refusals:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(root).__name__}:\n\t" + "\n\t".join(refusals))


def _refusing_before_loading(root: nn.Module, state: Mapping[str, Any], prefix: str, *args: Any) -> None:
    """A frozen model's load_state_dict pre-hook: a checkpoint that a stored weight refuses is
    refused before any tensor is copied (torch would have loaded the modules before it, an
    embedding and norms, and left the model a mix of two checkpoints)."""
    _refuse(root, state, prefix, [(name, m) for name, m in root.named_modules() if isinstance(m, StoredWeight)])


def pointing_to_freeze(compiled: nn.Module, state: Mapping[str, Any], prefix: str, *args: Any) -> None:
    """A graphquant model's load_state_dict pre-hook: a frozen model's checkpoint loads into it
    only through graphquant.freeze while it holds no stored weight (torch would list the stored
    weights' entries as unexpected and its weights as missing, naming no way to load them)."""
    stored = _stored_weight(state)
    if stored is not None and not any(isinstance(m, StoredWeight) for m in compiled.modules()):
        stored = without_compile_wrappers(stored)
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(compiled._orig_mod).__name__}: this is a frozen model's checkpoint ({stored} "
            "and others are stored quantized, with no high-precision weight), which an unfrozen model cannot load: "
            "load it with graphquant.freeze(compiled, state_dict=checkpoint), compiled by graphquant.compile(model, "
            "recipe, mode='inference') under the recipe it was frozen with"
        )


def _take_place(root: nn.Module, frozen: FrozenExperts) -> FrozenExperts:
    """Put ``frozen`` beside the parameter it stores and drop the parameter (its stand-in comes later)."""
    owner = root.get_submodule(_owner(frozen.name))
    del owner._parameters[frozen.parameter]
    owner.add_module(frozen.name.rpartition(".")[2], frozen)
    return frozen


def _owner(name: str) -> str:
    return name.rpartition(".")[0]


def _tie(name: str, tied: dict[int, list[str]], parameter: nn.Parameter) -> str:
    """Why ``parameter`` (named ``name``) keeps its values where another module shares it ("" where
    none does)."""
    others = [other for other in tied.get(id(parameter), ()) if other != name]
    return f"tied to {', '.join(others)}, which needs it" if others else ""


def _is_tied(name: str, tied: dict[int, list[str]], parameter: nn.Parameter) -> bool:
    """Whether ``parameter`` (named ``name``) is shared with another module, which needs it; warns."""
    tie = _tie(name, tied, parameter)
    if tie:
        user_stack.warn(f"graphquant.freeze leaves {name} with its high-precision values: it is {tie}")
    return bool(tie)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"graphquant.freeze: the checkpoint names the weight dtype {name!r}, which is no torch dtype")
    return dtype


def _weight_quantizer(backend: GraphquantBackend, name: str, shape: tuple[int, int]) -> Quantizer:
    """Linear ``name``'s weight quantizer as the latest graph that ran it on rows planned it (high
    precision for a small GEMM the recipe keeps so; a call of no rows, an empty batch, keeps its
    product in high precision for that call alone); where none has, as the first call's plan
    will: the recipe's, or high precision for a weight whose shape alone the plan keeps so (a
    router's few outputs), which a checkpoint of the model frozen after a call stores so too."""
    role = QuantizerRole("linear", "weight", name)
    planned = [
        dict(plan.slots)[role] for plan in backend.plans
        if role in dict(plan.slots) and not any(g.site.rpartition("#")[0] == name and g.reason.startswith(EMPTY_PRODUCT) for g in plan.gemms)
    ]
    if planned:
        return planned[-1]
    return IdentityQuantizer() if backend.planner.keeps_linear_in_high_precision(name, shape) else backend.planner.quantizer(role)


def _check_tiles(name: str, quantizer: Quantizer, shape: tuple[int, int]) -> None:
    """A linear's weight must tile its format as it is (a planned one does: its plan checked it;
    one the plan keeps in high precision for its shape is stored so: _weight_quantizer)."""
    try:
        quantizer.check_shape(shape, ROWWISE)
    except ValueError as error:
        raise ValueError(
            f"graphquant.freeze: {name}'s {shape[0]}x{shape[1]} weight cannot be stored as {quantizer}: {error} (nor would "
            "a call multiply it so: the plan refuses such a GEMM). Give the weight IdentityQuantizer() in the recipe's "
            "factory to keep it in high precision"
        ) from None


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


def _with_tied_entries(state: dict[str, Any], shared: list[list[str]]) -> None:
    """Give each name of a shared parameter (``shared``: each one's names) that ``state`` lacks the
    entry of another, in place: transformers' save_pretrained and safetensors save a tied weight
    once (an LM head tied to the embedding), and that checkpoint loads."""
    for names in shared:
        present = next((state[name] for name in names if name in state), None)
        if present is not None:
            for name in names:
                state.setdefault(name, present)


def _shared_parameters(root: nn.Module) -> dict[int, tuple[list[str], int]]:
    """id of each parameter under several names -> (those names, how many modules hold it). One
    module holds it where the module is registered under several names (nn.ModuleList([block] *
    n)): that shares it with no other module, and freeze puts one FrozenLinear in each place (_put)."""
    shared: dict[int, tuple[list[str], set[int]]] = {}
    for module_name, module in root.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is not None:
                names, holders = shared.setdefault(id(p), ([], set()))
                names.append(".".join(n for n in (module_name, name) if n))
                holders.add(id(module))
    return {key: (names, len(holders)) for key, (names, holders) in shared.items() if len(names) > 1}


def _put(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Put ``new`` in every place of ``old`` in ``root``: a module registered under several names
    is one module."""
    for name, module in list(root.named_modules(remove_duplicate=False)):
        if module is old:
            root.set_submodule(name, new)
