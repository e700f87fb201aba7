"""The inference configurations the inference benchmarks compare side by side, by name:

    bf16 torch.compile
    torchao PerRow, torchao PerTensor    Float8DynamicActivationFloat8WeightConfig (CUDA, torchao importable)
    graphquant RECIPE                    mode="inference": each weight quantized at each call
    graphquant RECIPE frozen             graphquant.freeze: weights stored quantized, bf16 dropped
    NAME (A quantized first)             a graphquant NAME whose plans refuse the decode GEMM that
                                         quantizes the activation itself (asked for by name only)

for RECIPE in RECIPES; and how many bytes a configuration's weights hold.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import sys
from typing import Callable

import torch

import graphquant
from graphquant import recipes, zoo
from graphquant.kernels import backends

RECIPES: dict[str, Callable[[], graphquant.CustomRecipe]] = {
    "tensorwise": lambda: zoo.recipe("tensorwise"),
    "rowwise": lambda: zoo.recipe("rowwise"),
    "deepseek_blockwise": lambda: zoo.recipe("deepseek_blockwise"),
    "mxfp8": recipes.mxfp8_block_scaling,
    "nvfp4": recipes.nvfp4_block_scaling,
}
TORCHAO = ("PerRow", "PerTensor")
BF16 = "bf16 torch.compile"
FROZEN = " frozen"
QUANTIZE_FIRST = " (A quantized first)"


def configs(requested: list[str] | None, device: torch.device) -> list[str]:
    """The configurations asked for (default: every one available on ``device``), in that order;
    an unknown or unavailable name stops the run, naming those available."""
    names = [BF16]
    if device.type == "cuda":
        try:
            import torchao.quantization  # noqa: F401

            names += [f"torchao {granularity}" for granularity in TORCHAO]
        except Exception as error:  # missing, or built for another torch (its import then fails in many ways)
            print(f"torchao does not import ({type(error).__name__}: {error}): its rows are left out", file=sys.stderr)
    names += [f"graphquant {recipe}{frozen}" for recipe in RECIPES for frozen in ("", FROZEN)]
    twins = [name + QUANTIZE_FIRST for name in names if name.startswith("graphquant ")]
    unknown = sorted(set(requested or ()) - set(names) - set(twins))
    if unknown:
        raise SystemExit(f"unknown or unavailable configs {unknown}; available here: {', '.join(names)}")
    return names if requested is None else requested


def build(
    config: str, model: torch.nn.Module, device: torch.device, cudagraphs: bool, backend: str | None = None, example: torch.Tensor | None = None
) -> torch.nn.Module:
    """``model``'s copy under ``config``, compiled (dynamic=False: each shape its own graph) by
    ``backend``, by default Inductor on CUDA and aot_eager on the CPU (no C++ build: a check that
    it runs). A frozen configuration of a model with expert stacks is called on ``example`` before
    graphquant.freeze, which learns the stacks from a compiled graph."""
    if config.endswith(QUANTIZE_FIRST):
        return QuantizingFirst(build(config.removesuffix(QUANTIZE_FIRST), model, device, cudagraphs, backend, example))
    model = copy.deepcopy(model)
    backend = backend or ("inductor" if device.type == "cuda" else "aot_eager")
    mode = {"mode": "reduce-overhead"} if cudagraphs else {}
    if config == BF16:
        return torch.compile(model, backend=backend, dynamic=False, **mode)
    if config.startswith("torchao "):
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_

        granularity = {"PerRow": PerRow, "PerTensor": PerTensor}[config.removeprefix("torchao ")]()
        quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=granularity))
        return torch.compile(model, backend=backend, dynamic=False, **mode)
    recipe = RECIPES[config.removeprefix("graphquant ").removesuffix(FROZEN)]()
    compile_mode = {"compile_mode": "reduce-overhead"} if cudagraphs else {}
    compiled = graphquant.compile(model, recipe, mode="inference", backend=backend, dynamic=False, **compile_mode)
    if not config.endswith(FROZEN):
        return compiled
    if example is not None and any(p.dim() == 3 for p in model.parameters()):
        with torch.no_grad():
            compiled(example)
    return graphquant.freeze(compiled)


@contextlib.contextmanager
def quantizing_first():
    """Plans made inside refuse the decode GEMM that quantizes A itself."""
    refusal = backends.triton_decode.quantize_on_load_refusal
    backends.triton_decode.quantize_on_load_refusal = lambda quantizer: "refused by the benchmark: A quantized first"
    backends.clear_caches()
    try:
        yield
    finally:
        backends.triton_decode.quantize_on_load_refusal = refusal
        backends.clear_caches()


class QuantizingFirst(torch.nn.Module):
    """A compiled model whose first call at each input shape (the one that plans and compiles its
    graph) runs under quantizing_first; later calls go straight through, so that they are timed
    as the model's own."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.planned = model, set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape in self.planned:
            return self.model(x)
        with quantizing_first():
            output = self.model(x)
        self.planned.add(x.shape)
        return output


def allow_graphs(graphs: int) -> None:
    """Let Dynamo keep ``graphs`` graphs of one forward. Before torch 2.13 the models a benchmark
    compiles from one module class share that count (bf16 torch.compile's graphs carry no guard on
    their module, so they count against every copy); past the limit torch.compile falls back to
    eager and graphquant raises RecompileLimitError, so the benchmark's later rows would time
    neither."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, graphs)


def inference_model(kind: str, tiny: bool, device: torch.device, blocks: int = 2) -> tuple[torch.nn.Module, int, str]:
    """(the model the inference benchmarks time, its input's width, a line describing it): ``kind``
    "ffn", ``blocks`` Llama-3-8B SwiGLU FFN blocks (models.FFNStack), or "moe", moe_step.py's MoE
    layer; bf16, in eval mode, on ``device``; ``tiny``: small dims for the CPU."""
    from models import DIM, HIDDEN, FFNStack, MoE
    from moe_step import SHAPES, TINY

    torch.manual_seed(0)
    if kind == "moe":
        shapes = TINY if tiny else SHAPES
        described = "an MoE layer (" + ", ".join(f"{key} {value}" for key, value in shapes.items()) + ")"
        return MoE(**shapes).to(device).eval(), shapes["dim"], described
    dim, hidden = (128, 256) if tiny else (DIM, HIDDEN)
    described = f"{blocks} SwiGLU FFN blocks ({dim} -> {hidden} -> {dim})"
    return FFNStack(blocks, dim=dim, hidden=hidden).to(device, torch.bfloat16).eval(), dim, described


def per_call(config: str) -> str | None:
    """The per-call configuration a frozen one stores the weights of (None for any other)."""
    return config.removesuffix(FROZEN) if config.endswith(FROZEN) else None


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements; a tensor subclass (torchao's quantized weights) by its inner tensors."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model``, each storage counted once (a frozen
    expert stack's stand-in is one expert's, shared by the stacks of its shape)."""
    tensors = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    plain = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values() if not hasattr(t, "__tensor_flatten__")}
    return sum(plain.values()) + sum(tensor_bytes(t) for t in tensors.values() if hasattr(t, "__tensor_flatten__"))
