"""The command line: print the plan (or the numerics report) of a model you name.

    python -m graphquant explain MODULE:ATTR --recipe NAME [--input-shape 4,128,512 ...]
    python -m graphquant numerics MODULE:ATTR --recipe NAME [--input-shape 4,128,512 ...]

MODULE:ATTR is importable from the current directory: a model, or a function of no arguments
that returns a model or (model, example_inputs). NAME is a zoo recipe (graphquant.zoo.FACTORIES),
a preset of graphquant.recipes (e.g. mxfp8_block_scaling), or MODULE:ATTR naming a CustomRecipe,
a function of no arguments that returns one, or a factory(role). Each --input-shape adds one
random example input. numerics differentiates the sum of every floating tensor the model returns.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import sys
from typing import Any, Callable, Optional, Sequence

import torch

from graphquant import recipes, zoo
from graphquant.explainer import explain
from graphquant.numerics_report import numerics
from graphquant.quantizers import Quantizer
from graphquant.recipes import CustomRecipe


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m graphquant", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for command, what in (("explain", "print the plan table"), ("numerics", "print the per-GEMM numerics report")):
        sub = commands.add_parser(command, help=what, description=f"{what} of a model under a recipe")
        sub.add_argument("model", help="MODULE:ATTR: a model, or a function returning a model or (model, example_inputs)")
        sub.add_argument("--recipe", required=True, help="a zoo name, a graphquant.recipes preset, or MODULE:ATTR")
        sub.add_argument("--input-shape", action="append", type=_shape, default=[], help="e.g. 4,128,512; repeat per input")
        sub.add_argument(
            "--dtype", choices=("float32", "bfloat16", "float16"),
            help="of the inputs (random, or those the model brings), the model's floating tensors cast to it (default: the model's own dtype)",
        )
        sub.add_argument("--json", action="store_true", help="print JSON instead of a table")
    commands.choices["explain"].add_argument(
        "--mode", choices=("training", "inference"), default="training",
        help="the plan of a training call (fprop, dgrad, wgrad) or of an inference one (fprop alone, as mode='inference' compiles)",
    )
    args = parser.parse_args(argv)

    try:
        model, inputs = load_model(args.model)
        recipe = load_recipe(args.recipe)
        if args.input_shape:
            dtype = getattr(torch, args.dtype) if args.dtype else _floating_dtype(model)
            model = model.to(dtype)  # torch's products take operands of one dtype
            inputs = tuple(torch.randn(shape, dtype=dtype) for shape in args.input_shape)
        elif args.dtype:  # the inputs the model brings, cast with it
            dtype = getattr(torch, args.dtype)
            model = model.to(dtype)
            inputs = tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)
        if not inputs:
            raise ValueError(f"{args.model} brings no example inputs: give --input-shape")
        if args.command == "explain":
            command = functools.partial(explain, mode="inference") if args.mode == "inference" else explain
        else:
            command = functools.partial(numerics, loss_fn=summed_outputs)
        result = run(command, args.model, model, recipe, inputs)
    except (ValueError, TypeError) as error:  # PlanError included
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(result.to_json() if args.json else result)
    return 0


def _floating_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's first floating parameter (float32 where it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def run(command: Callable, spec: str, model: torch.nn.Module, recipe: CustomRecipe, inputs: tuple[Any, ...]) -> Any:
    """``command(model, recipe, *inputs)``. Where it fails and so does the model run eagerly (a
    mistake in the inputs, which under torch.compile surfaces as a long Dynamo trace), a ValueError
    that names the inputs' shapes and the model's own error."""
    fake_tensor_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_tensor_log.level
    fake_tensor_log.setLevel(logging.CRITICAL)  # it logs such a mistake with a traceback before Dynamo raises it
    try:
        return command(model, recipe, *inputs)
    except (ValueError, TypeError):  # graphquant's, which say what to change
        raise
    except Exception:
        try:
            with torch.no_grad():
                model(*inputs)
        except Exception as error:
            shapes = ", ".join("x".join(map(str, x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__ for x in inputs)
            first_line = next(iter(str(error).strip().splitlines()), "")
            raise ValueError(
                f"{spec} fails on inputs of shape {shapes}, without graphquant too: {type(error).__name__}: {first_line}"
            ) from None
        raise
    finally:
        fake_tensor_log.setLevel(level)


def summed_outputs(output: Any) -> torch.Tensor:
    """The command line's loss for numerics: the sum of every floating tensor the model returns
    (a transformers model's logits, its loss where it has one)."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise TypeError(f"the model returned a {type(output).__name__} holding no floating tensor: nothing to differentiate")
    return sum(t.float().sum() for t in leaves)


def load_model(spec: str) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """(model, example inputs, possibly empty) from MODULE:ATTR."""
    target = _load(spec)
    if isinstance(target, torch.nn.Module):
        return target, ()
    if not callable(target):
        raise TypeError(f"{spec} is of type {type(target).__name__}: name an nn.Module, or a function of no arguments returning one")
    made = target()
    model, inputs = (made[0], tuple(made[1])) if isinstance(made, tuple) else (made, ())
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{spec}() returned an object of type {type(model).__name__}, not an nn.Module (or a tuple (model, example_inputs))")
    return model, inputs


def load_recipe(name: str) -> CustomRecipe:
    """A zoo recipe, a preset, or MODULE:ATTR naming a CustomRecipe, a function of no arguments
    that returns one, or a factory(role)."""
    if name in zoo.FACTORIES:
        return zoo.recipe(name)
    if name in recipes.PRESETS:
        return recipes.PRESETS[name]()
    if ":" in name:
        target = _load(name)
        if callable(target) and not isinstance(target, (type, CustomRecipe, Quantizer)):  # a quantizer: require says what to do
            if recipes.accepts(target, 1):
                target = CustomRecipe(target)
            elif recipes.accepts(target, 0):
                target = target()
        return recipes.require(target)
    raise ValueError(f"unknown recipe {name!r}; known: {', '.join([*zoo.FACTORIES, *recipes.PRESETS])}, or MODULE:ATTR")


def _load(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"{spec!r} is not MODULE:ATTR")
    try:
        target: Any = importlib.import_module(module)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot load {spec}: {error}") from None
    return target


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(size) for size in text.split(","))


if __name__ == "__main__":
    sys.exit(main())
