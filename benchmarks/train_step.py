"""One training step (forward + backward) of Llama-3-8B-shaped models under every recipe.

    python benchmarks/train_step.py [--models ffn,decoder] [--configs ...] [--rounds 3]

Prints one table: ms per step (median over rounds that alternate the configurations, each sample
``--steps`` steps back to back), effective TFLOP/s, speedup over the best of bf16 eager and bf16
torch.compile, peak GPU memory, and the distance to the FP8-GEMM-only bound (the step's linear GEMMs at raw torch._scaled_mm
speed measured in this run, plus the measured bf16 attention kernels), and the GPU energy per
step with the average power over the timed samples (NVML's energy counter; FP8 steps run at the
power limit, so their time follows their energy). Asked for by name,
"bf16 torch.compile", "graphquant tensorwise" and "torchao tensorwise" also run with Inductor's
coordinate-descent tuning (the name with " (coordinate descent)"), beside their defaults; its
tuning adds minutes of compile time per config. "graphquant tensorwise" and "torchao tensorwise"
also run with fast accumulation in dgrad and wgrad (the name with " (fast accumulation
everywhere)"), a user's choice in both libraries, not their default. "graphquant tensorwise" and
"graphquant mxfp8" also run with attention quantized (the name with " (fp8 attention)":
zoo.with_fp8_attention, TE's fp8_dpa roles), to compare with the same linears and bf16 attention,
and, with "bf16 torch.compile", with Inductor rounding bf16 intermediates as eager does (the name
with " (eager casts)": options={"emulate_precision_casts": True});
``--seq`` sets the decoder's sequence length (16384 tokens a step at any length).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys

import torch
from tabulate import tabulate
from torch._inductor import list_mode_options

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import alternate, print_algorithm_choices, profile, time_ms, training_step, warm_peak_gib  # noqa: E402
from models import DecoderLayer, FFNStack, attention_flops, linear_gemm_shapes  # noqa: E402

import graphquant  # noqa: E402
from graphquant import recipes, zoo  # noqa: E402

TOKENS, DIM = 16384, 4096

GRAPHQUANT = {
    "graphquant tensorwise": lambda: zoo.recipe("tensorwise"),
    "graphquant deepseek_blockwise": lambda: zoo.recipe("deepseek_blockwise"),
    "graphquant rowwise_with_gw_hp": lambda: zoo.recipe("rowwise_with_gw_hp"),
    "graphquant mxfp8": recipes.mxfp8_block_scaling,
    "graphquant mxfp8_fwd_nvfp4_bwd": lambda: zoo.recipe("mxfp8_fwd_nvfp4_bwd"),
}
TORCHAO = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# A compiled config's name with this suffix compiles with Inductor's coordinate-descent tuning:
# measured only when asked for by name, side by side with the default.
COORDINATE_DESCENT = " (coordinate descent)"
# With this suffix, dgrad and wgrad accumulate in the tensor cores' accumulator too (fprop does by
# default, in both libraries): CustomRecipe.fast_accumulation, torchao's Float8GemmConfig.
FAST_EVERYWHERE = " (fast accumulation everywhere)"
OPT_IN = [f"{name}{COORDINATE_DESCENT}" for name in ("bf16 torch.compile", "graphquant tensorwise", "torchao tensorwise")]
OPT_IN += [f"{name}{FAST_EVERYWHERE}" for name in ("graphquant tensorwise", "torchao tensorwise")]
# With this suffix, a graphquant recipe quantizes attention too (zoo.with_fp8_attention).
FP8_ATTENTION = " (fp8 attention)"
OPT_IN += [f"{name}{FP8_ATTENTION}" for name in ("graphquant tensorwise", "graphquant mxfp8")]
# With this suffix, Inductor rounds each bf16 intermediate of a fused chain as eager does
# (emulate_precision_casts), so the quantizers see the model's own bf16 values in every graph.
EAGER_CASTS = " (eager casts)"
OPT_IN += [f"{name}{EAGER_CASTS}" for name in ("bf16 torch.compile", "graphquant tensorwise", "graphquant mxfp8")]
# With this suffix, a compiled config runs as CUDA graphs (torch.compile's "reduce-overhead"): the
# host's launches leave the step, which matters where they outlast the GPU's work (the emulated
# recipes' many small launches on the decoder). Tensorwise's is in the default list.
CUDAGRAPHS = " (cudagraphs)"
OPT_IN += [
    f"{name}{CUDAGRAPHS}"
    for name in ("bf16 torch.compile", "graphquant mxfp8", "graphquant mxfp8_fwd_nvfp4_bwd", "torchao tensorwise")
]


def build(config: str, model: torch.nn.Module, compile_mode: str | None):
    model = copy.deepcopy(model)
    if config == "bf16 eager":
        return model
    cudagraphs, config = config.endswith(CUDAGRAPHS), config.removesuffix(CUDAGRAPHS)
    compile_mode = "reduce-overhead" if cudagraphs else compile_mode
    # torch.compile takes a mode or options, not both: the mode's options, then ours.
    options = {**(list_mode_options(compile_mode) if compile_mode else {})}
    if config.endswith(COORDINATE_DESCENT):
        config, options["coordinate_descent_tuning"] = config.removesuffix(COORDINATE_DESCENT), True
    if config.endswith(EAGER_CASTS):
        config, options["emulate_precision_casts"] = config.removesuffix(EAGER_CASTS), True
    fast_everywhere, config = config.endswith(FAST_EVERYWHERE), config.removesuffix(FAST_EVERYWHERE)
    fp8_attention, config = config.endswith(FP8_ATTENTION), config.removesuffix(FP8_ATTENTION)
    if config == "bf16 torch.compile":
        return torch.compile(model, options=options)
    if config in GRAPHQUANT:
        recipe = GRAPHQUANT[config]()
        if fast_everywhere:
            recipe = dataclasses.replace(recipe, fast_accumulation=recipes.GEMM_NAMES)
        if fp8_attention:
            recipe = zoo.with_fp8_attention(recipe)
        return graphquant.compile(model, recipe, options=options)
    from torchao.float8 import Float8GemmConfig, Float8LinearConfig, convert_to_float8_training

    ao_config = Float8LinearConfig.from_recipe_name(config.removeprefix("torchao "))
    if fast_everywhere:
        fast = Float8GemmConfig(use_fast_accum=True)
        ao_config = dataclasses.replace(ao_config, gemm_config_grad_input=fast, gemm_config_grad_weight=fast)
    convert_to_float8_training(model, config=ao_config)
    return torch.compile(model, options=options)


def configs(requested: list[str] | None) -> list[str]:
    names = ["bf16 eager", "bf16 torch.compile", *GRAPHQUANT, f"graphquant tensorwise{CUDAGRAPHS}"]
    try:
        import torchao.float8  # noqa: F401

        names += [f"torchao {n}" for n in TORCHAO]
    except ImportError:
        print("torchao is not importable: its rows are left out", file=sys.stderr)
    # An opt-in variant runs where its base config does.
    names += [n for n in OPT_IN if requested is not None and n in requested and n.split(" (")[0] in names]
    return [n for n in names if requested is None or n in requested]


def saved_for_backward(name: str, step, existing: list[torch.Tensor]) -> None:
    """Print what one step's forward keeps for its backward (distinct storages, by dtype and shape,
    leaving out ``existing`` ones such as parameters): the activation memory a recipe adds or
    saves against bf16."""
    seen, sizes = {t.untyped_storage().data_ptr() for t in existing}, {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            key = (str(t.dtype).removeprefix("torch."), tuple(t.shape))
            count, nbytes = sizes.get(key, (0, 0))
            sizes[key] = (count + 1, nbytes + storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    torch.cuda.synchronize()
    rows = sorted(([nbytes / 2**20, count, dtype, shape] for (dtype, shape), (count, nbytes) in sizes.items()), reverse=True)
    print(f"--- {name}: saved for backward, {sum(r[0] for r in rows) / 1024:.2f} GiB in {sum(r[1] for r in rows)} storages", file=sys.stderr)
    print(tabulate(rows[:20], headers=["MiB", "count", "dtype", "shape"], floatfmt=".0f"), file=sys.stderr)


def memory_at_peak(name: str, step, keep: str | None) -> None:
    """Print what is live at one step's allocation peak, grouped by the source line that allocated
    it (for compiled graphs, the line of Inductor's generated code), and with ``keep`` write the
    allocator trace and those generated files there, to read offline."""
    import linecache
    import os
    import pickle
    import shutil

    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    step()
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(enabled=None)
    live, total, peak, at_peak, last = {}, 0, 0, {}, None
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, at_peak, last = total, dict(live), event
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]

    def site(event) -> tuple[str, int, str, str]:
        """The allocating line outside torch, and the line of Inductor's generated code that led
        there (which op of the graph allocated it, where the allocating line is a library's)."""
        unknown = {"filename": "?", "line": 0, "name": "?"}
        frames = [f for f in event["frames"] if "/torch/" not in f["filename"]] or event["frames"] or [unknown]
        graph = next((f for f in frames if "torchinductor" in f["filename"]), None)
        caller = f"{os.path.basename(graph['filename'])[:8]}:{graph['line']}" if graph and graph is not frames[0] else ""
        return frames[0]["filename"], frames[0]["line"], frames[0]["name"], caller

    sites: dict[tuple[str, int, str, str], list[int]] = {}
    for event in at_peak.values():
        sites.setdefault(site(event), []).append(event["size"])
    rows = sorted(
        ([sum(sizes) / 2**20, len(sizes), f"{os.path.basename(f)}:{line} {fn}", caller, linecache.getline(f, line).strip()[:100]]
         for (f, line, fn, caller), sizes in sites.items()),
        reverse=True,
    )
    print(f"--- {name}: {peak / 2**30:.2f} GiB allocated during the step at its peak, by allocating line", file=sys.stderr)
    print(tabulate(rows[:40], headers=["MiB", "blocks", "where", "from graph line", "line"], floatfmt=".0f"), file=sys.stderr)
    f, line, fn, caller = site(last)
    print(f"    the peak's last allocation: {last['size'] / 2**20:.0f} MiB at {os.path.basename(f)}:{line} {caller}", file=sys.stderr)
    if keep:
        folder = os.path.join(keep, name.replace(" ", "_"))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "trace.pkl"), "wb") as f:
            pickle.dump({"trace": trace, "peak": peak}, f)
        generated = {f["filename"] for event in at_peak.values() for f in event["frames"] if "torchinductor" in f["filename"]}
        for f in {f for f in generated if os.path.exists(f)}:
            shutil.copy(f, folder)


def measure(
    model_name: str, base: torch.nn.Module, names: list[str], rounds: int, steps: int, compile_mode: str | None,
    profiled: list[str], memory: list[str], keep: str | None, seq: int,
) -> list[list]:
    batch = TOKENS // seq
    x = torch.randn(batch, seq, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    built, peaks = {}, {}
    for name in names:
        model = build(name, base, compile_mode)
        built[name] = step = training_step(model, x, grad)
        peaks[name] = warm_peak_gib(step)
        if name in profiled:
            profile(name, step)
            saved_for_backward(name, step, [x, *model.parameters()])
        if name in memory:
            memory_at_peak(f"{model_name} {name}", step, keep)
        if name.endswith(CUDAGRAPHS):
            from torch._dynamo.utils import counters

            print(f"  cudagraph skips so far: {counters['inductor']['cudagraph_skips']}", file=sys.stderr)
        print(f"  built {model_name} / {name}", file=sys.stderr, flush=True)
    joules: dict[str, float] = {}
    ms = alternate(built, rounds=rounds, warmup=1, reps=5, inner=steps, joules=joules)

    shapes = linear_gemm_shapes(base, batch * seq)
    flops = sum(2 * m * n * k for m, n, k in shapes) + attention_flops(base, batch, seq)
    bound = fp8_gemm_bound(shapes) + sdpa_ms(base, x)
    baseline = min(ms.get("bf16 eager", float("inf")), ms.get("bf16 torch.compile", float("inf")))

    def speedup(ms_step: float) -> str:  # blank where no bf16 config ran
        return f"{baseline / ms_step:.2f}x" if baseline < float("inf") else ""

    rows = [[model_name, "FP8-GEMM-only bound", f"{bound:.1f}", f"{flops / bound / 1e9:.0f}", speedup(bound), "", "1.00", "", ""]]
    for name in names:
        energy = [f"{joules[name]:.1f}", f"{joules[name] / ms[name] * 1000:.0f}"] if name in joules else ["", ""]
        # A CUDA graph's memory is its private pool, allocated at capture: a replay allocates nothing.
        peak = "" if name.endswith(CUDAGRAPHS) else f"{peaks[name]:.2f}"
        rows.append([
            model_name, name, f"{ms[name]:.1f}", f"{flops / ms[name] / 1e9:.0f}", speedup(ms[name]),
            peak, f"{ms[name] / bound:.2f}", *energy,
        ])
    return rows


def fp8_gemm_bound(shapes: list[tuple[int, int, int]]) -> float:
    """ms of the step's linear GEMMs run as raw tensorwise torch._scaled_mm, shape by shape."""
    total, one = 0.0, torch.ones((), device="cuda")
    for (m, n, k) in sorted(set(shapes)):
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        total += shapes.count((m, n, k)) * time_ms(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16))
    return total


def sdpa_ms(model: torch.nn.Module, x: torch.Tensor) -> float:
    """ms of forward + backward of the model's attention kernels alone, in bf16."""
    from models import Attention

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        return 0.0
    att, (batch, seq, _) = layers[0], x.shape
    shape = (batch, att.heads, seq, att.head_dim)
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = (batch, att.kv_heads, seq, att.head_dim)
    k = torch.randn(kv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(kv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def run():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(g)

    return len(layers) * time_ms(run)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="ffn,decoder")
    parser.add_argument("--configs", default=None, help="comma-separated config names (default: all)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--steps", type=int, default=4,
        help="steps per timed sample, run back to back as a training loop runs them (the host prepares a "
        "step while the GPU runs the previous one; 1 also times the GPU waiting for the step's first launch)",
    )
    parser.add_argument("--compile-mode", default=None, help="torch.compile mode for every compiled config")
    parser.add_argument("--seq", type=int, default=2048, help=f"sequence length ({TOKENS} tokens a step: a batch of {TOKENS} // seq)")
    parser.add_argument("--profile", default="", help="comma-separated configs whose kernels and saved tensors to list")
    parser.add_argument("--memory", default="", help="comma-separated configs whose live memory at the peak to list")
    parser.add_argument("--memory-dir", default=None, help="where --memory also writes the allocator trace and generated code")
    args = parser.parse_args()
    names = configs(args.configs.split(",") if args.configs else None)
    # Every compiled model adds an entry to the cache of one shared Dynamo frame (a module call's
    # wrapper); past the default 8 the next model silently runs eager, so later configs would
    # measure eager speed.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(names))
    torch.manual_seed(0)
    rows = []
    for model_name in args.models.split(","):
        base = (FFNStack() if model_name == "ffn" else DecoderLayer()).to("cuda", torch.bfloat16)
        rows += measure(model_name, base, names, args.rounds, args.steps, args.compile_mode, args.profile.split(","),
                        args.memory.split(","), args.memory_dir, args.seq)
        del base
        torch.cuda.empty_cache()
    headers = ["model", "config", "ms/step", "TFLOP/s", "speedup vs best bf16", "peak GiB", "x bound", "J/step", "W"]
    print(tabulate(rows, headers=headers))
    print_algorithm_choices()


if __name__ == "__main__":
    main()
