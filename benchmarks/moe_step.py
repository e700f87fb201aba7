"""One training step (forward + backward) of a DeepSeek-V3 / Qwen3-MoE style layer (models.MoE)
under bf16 torch._grouped_mm, graphquant's recipes and torchao's MoE training.

    python benchmarks/moe_step.py [--configs ...] [--tokens 16384] [--rounds 3]
    python benchmarks/moe_step.py --tiny          # CPU, small shapes: that every config runs
    python benchmarks/moe_step.py --configs "bf16 torch.compile,graphquant rowwise" --profile "graphquant rowwise"
    python benchmarks/moe_step.py --configs "graphquant rowwise" --memory "graphquant rowwise" --keep /tmp/peak --inductor reorder_for_peak_memory=True

Default shapes: 64 experts, top-8, model dim 4096, expert hidden 1408 (DeepSeek-V2-Lite's
expert width), one shared expert of 2816, 16384 tokens. Prints ms per step (median over rounds
in which the configurations take turns), effective TFLOP/s of the step's GEMMs, speedup over
bf16 torch.compile and the peak memory a step allocates on top of the model. A configuration
that fails prints its error in the table instead of a time. torchao's row is its FP8 rowwise
grouped GEMMs (torchao.prototype.moe_training, Float8TrainingOpConfig through quantize_, token
groups padded to 16 by the model), present where torchao imports.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import statistics
import sys
import time
import traceback

import torch
from tabulate import tabulate

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import alternate, profile, training_step, warm_peak_gib  # noqa: E402
from models import GroupedSwiGLU, MoE  # noqa: E402
from train_step import memory_at_peak, saved_for_backward  # noqa: E402

import graphquant  # noqa: E402
from graphquant import recipes, zoo  # noqa: E402

GRAPHQUANT = {
    "graphquant rowwise": lambda: zoo.recipe("rowwise"),
    # torchao's FP8 grouped GEMMs sum in the tensor cores' accumulator (torch._scaled_grouped_mm):
    # the same choice for all three GEMMs, where graphquant's default promotes dgrad's and wgrad's.
    "graphquant rowwise (fast accumulation everywhere)": lambda: dataclasses.replace(
        zoo.recipe("rowwise"), fast_accumulation=recipes.GEMM_NAMES
    ),
    "graphquant tensorwise": lambda: zoo.recipe("tensorwise"),
    "graphquant deepseek_blockwise": lambda: zoo.recipe("deepseek_blockwise"),
    "graphquant mxfp8": recipes.mxfp8_block_scaling,
    "graphquant nvfp4_row_scaled_fwd_mxfp8_bwd": lambda: zoo.recipe("nvfp4_row_scaled_fwd_mxfp8_bwd"),
}
TORCHAO = "torchao fp8_rowwise"
SHAPES = {"dim": 4096, "experts": 64, "top_k": 8, "hidden": 1408, "shared_hidden": 2816}
TINY = {"dim": 64, "experts": 4, "top_k": 2, "hidden": 64, "shared_hidden": 64}


def build(config: str, model: torch.nn.Module, backend: str, options: dict):
    model = copy.deepcopy(model)
    if config == "bf16 eager":
        return model
    if config == "bf16 torch.compile":
        return torch.compile(model, backend=backend, options=options or None)
    if config in GRAPHQUANT:
        return graphquant.compile(model, GRAPHQUANT[config](), backend=backend, options=options or None)
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    # The experts' weights alone: their grouped GEMMs in FP8 rowwise. torchao 0.18's FP8 grouped
    # GEMM needs every expert's rows a multiple of 16 and refuses to pad them itself
    # (pad_token_groups_for_grouped_mm=True fails an assert), so the model pads, as TorchTitan's does.
    model.token_group_alignment = 16
    quantize_(model, Float8TrainingOpConfig(), filter_fn=lambda module, fqn: isinstance(module, GroupedSwiGLU))
    return torch.compile(model, backend=backend, options=options or None)


def inductor_options(text: str) -> dict:
    """``key=value,...`` Inductor config settings (values: Python literals, e.g. False, 4)."""
    return {key.strip(): ast.literal_eval(value.strip()) for key, value in (item.split("=", 1) for item in text.split(",") if item)}


def configs(requested: list[str] | None) -> list[str]:
    names = ["bf16 eager", "bf16 torch.compile", *GRAPHQUANT]
    try:
        import torchao.prototype.moe_training  # noqa: F401

        names.append(TORCHAO)
    except ImportError as error:
        print(f"torchao's MoE training does not import ({error}): its row is left out", file=sys.stderr)
    return [n for n in names if requested is None or n in requested]


def cpu_ms(step, reps: int) -> float:
    """Mean ms of ``reps`` back-to-back steps on the CPU."""
    begin = time.perf_counter()
    for _ in range(reps):
        step()
    return (time.perf_counter() - begin) * 1e3 / reps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default=None, help="comma-separated config names (default: all)")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5, help="timed samples a round (CUDA) or steps a sample (CPU)")
    parser.add_argument("--profile", default="", help="comma-separated configs whose step to profile (CUDA kernels by time)")
    parser.add_argument("--tiny", action="store_true", help="CPU, small shapes, aot_eager: a check that every config runs")
    parser.add_argument("--memory", default="", help="comma-separated configs whose saved tensors and live memory at the peak to list")
    parser.add_argument("--keep", default=None, help="with --memory: a folder for each config's allocator trace and the Inductor code live at its peak")
    parser.add_argument("--inductor", default="", help="Inductor config settings for every compiled config, e.g. reorder_for_peak_memory=False")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    shapes = TINY if args.tiny else SHAPES
    tokens = 64 if args.tiny else args.tokens
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    names = configs(args.configs.split(",") if args.configs else None)

    torch.manual_seed(0)
    base = MoE(**shapes).to(device)
    x = torch.randn(tokens, shapes["dim"], device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    steps, models, failed, peaks = {}, {}, {}, {}
    for name in names:
        try:
            models[name] = build(name, base, backend, inductor_options(args.inductor))
            step = training_step(models[name], x, grad)
            if device.type == "cuda":
                peaks[name] = warm_peak_gib(step)
            else:
                step(); step()  # compile and warm up
            steps[name] = step
        except Exception as error:  # a row that says why, and the others still measured
            traceback.print_exc()
            failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
        print(f"  built {name}", file=sys.stderr, flush=True)

    if device.type == "cuda":
        ms = alternate(steps, rounds=args.rounds, warmup=1, reps=args.reps)
    else:
        ms = {name: statistics.median(cpu_ms(step, args.reps) for _ in range(args.rounds)) for name, step in steps.items()}
    flops = base.step_flops(tokens)
    baseline = ms.get("bf16 torch.compile", ms.get("bf16 eager"))
    rows = []
    for name in names:
        if name in failed:
            rows.append([name, "", "", "", "", failed[name]])
            continue
        speedup = f"{baseline / ms[name]:.2f}x" if baseline else ""
        peak = f"{peaks[name]:.2f}" if name in peaks else ""
        rows.append([name, f"{ms[name]:.2f}", f"{flops / ms[name] / 1e9:.0f}", speedup, peak, ""])
    print(
        f"MoE training step on {device}: {tokens} tokens, {shapes['experts']} experts, top-{shapes['top_k']}, "
        f"dim {shapes['dim']}, expert hidden {shapes['hidden']}, shared expert {shapes['shared_hidden']}, {backend}"
    )
    print(tabulate(rows, headers=["config", "ms/step", "TFLOP/s", "vs bf16 compile", "peak GiB", "failed"], tablefmt="github"), flush=True)
    for name in args.profile.split(",") if args.profile and device.type == "cuda" else ():
        if name in steps:
            profile(name, steps[name])
        else:
            print(f"--profile {name!r}: not among the configs that ran ({', '.join(steps)})", file=sys.stderr)
    for name in args.memory.split(",") if args.memory and device.type == "cuda" else ():
        if name in steps:
            saved_for_backward(name, steps[name], [x, *models[name].parameters()])
            memory_at_peak(name, steps[name], args.keep)
        else:
            print(f"--memory {name!r}: not among the configs that ran ({', '.join(steps)})", file=sys.stderr)


if __name__ == "__main__":
    main()
