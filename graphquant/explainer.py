"""graphquant.explain: the plan graphquant makes for a model, before any training step."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import fx

from graphquant import compiler
from graphquant.passes.plan import Plan
from graphquant.recipes import CustomRecipe

# Static shapes, unless asked otherwise, so the plan's backend choice sees every size whatever
# earlier compiles of the same code saw (Dynamo would otherwise make a dim that changed symbolic).
_DEFAULTS = {"dynamic": False}


def run_eagerly(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """An inner backend that runs the rewritten graph as plain Python, so real tensors reach
    graphquant.ops.functional and no compiler time is spent."""
    return gm.forward


def run_once(
    model: Any, recipe: CustomRecipe, example_inputs: Sequence[Any], compile_kwargs: dict, example_kwargs: Optional[dict] = None
) -> tuple[Any, Any]:
    """(compiled model, output) after one forward of ``model(*example_inputs, **example_kwargs)``
    under graphquant, run eagerly.

    Rejected GEMMs stay in the plan instead of failing the compile; a plan error (a shape a
    format cannot tile, a factory that raised) fails it.
    """
    if "backend" in compile_kwargs:
        raise TypeError(
            "graphquant.explain and graphquant.numerics run the rewritten graph eagerly, so that each GEMM is seen as it "
            f"runs; they take no backend (got backend={compile_kwargs['backend']!r})"
        )
    if compile_kwargs.get("disable"):
        raise TypeError("graphquant.explain and graphquant.numerics plan the GEMMs of the graphs torch.compile captures, "
                        "which disable=True switches off: call them without disable")
    compiled = compiler.compile(model, recipe, backend=run_eagerly, **(_DEFAULTS | compile_kwargs))
    compiled.graphquant.planner.fail_on_bucket = False
    output = compiled(*example_inputs, **(example_kwargs or {}))
    if not compiled.graphquant.plans:
        raise RuntimeError(
            "torch.compile sent graphquant no graph: Dynamo captured nothing of this forward (torch.compiler.disable, "
            "or the recompile limit reached?)"
        )
    return compiled, output


def explain(model: Any, recipe: CustomRecipe, *example_inputs: Any, example_kwargs: Optional[dict] = None, **compile_kwargs: Any) -> Plan:
    """The plan of every GEMM of ``model`` under ``recipe``: fprop, dgrad and wgrad per site.

    Runs one forward on ``example_inputs`` (and the model's keyword inputs ``example_kwargs``,
    an attention_mask say) with grad enabled and no backward; the model is not
    changed (though a module that updates state in forward, like BatchNorm in train mode, does
    so once). compile_kwargs are graphquant.compile's (strict, mode, dump_dir, ...) and
    torch.compile's; mode="inference" gives the inference plan (fprop only, from a forward
    without grad, as inference runs). strict=True shows every GEMM it would reject. A model
    that compiles into several graphs (graph breaks) gets one plan, in graph order.
    """
    with torch.set_grad_enabled(compile_kwargs.get("mode") != "inference"):
        compiled, _ = run_once(model, recipe, example_inputs, compile_kwargs, example_kwargs)
    return Plan.combine(compiled.graphquant.plans)
