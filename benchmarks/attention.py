"""TFLOP/s of attention: bf16 F.scaled_dot_product_attention per backend torch offers, beside
graphquant's FP8 attention (graphquant.ops.attention, as a compiled graph calls it).

    python benchmarks/attention.py [--seqs 2048,8192,16384] [--rounds 3]

32 heads of dim 128, bf16, a batch of 16384 // seq sequences (16k tokens), causal and not,
forward alone and forward + backward. TFLOP/s count the products (4 b h Lq Lk d forward, 2.5
times that backward) and a causal attention as half of those. The FP8 rows are the recipes'
attention formats: nvfp4_linear_fp8_dpa's (per-tensor FP8, s and dp delayed) and MXFP8; until a
native kernel runs them they are the exact emulation, which materialises S and P (so they run
out of memory first: such a row says "OOM").
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import alternate  # noqa: E402

import graphquant  # noqa: E402,F401  (registers the ops)
from graphquant import factories, zoo  # noqa: E402
from graphquant.ops.attention import SLOTS, AttentionSite, quantized_attention  # noqa: E402
from graphquant.passes.find_attention import DpaSite  # noqa: E402
from graphquant.passes.plan import Planner  # noqa: E402
from graphquant.recipes import CustomRecipe  # noqa: E402

HEADS, HEAD_DIM, TOKENS = 32, 128, 16384
BACKENDS = {
    "bf16 sdpa flash": SDPBackend.FLASH_ATTENTION,
    "bf16 sdpa cudnn": SDPBackend.CUDNN_ATTENTION,
    "bf16 sdpa efficient": SDPBackend.EFFICIENT_ATTENTION,
}
RECIPES = {
    "graphquant fp8 (nvfp4_linear_fp8_dpa)": zoo.recipe("nvfp4_linear_fp8_dpa"),
    "graphquant mxfp8": CustomRecipe(factories.mxfp8_factory, fp8_dpa=True),
}


def attention_site(recipe: CustomRecipe, device: str = "cuda") -> tuple[AttentionSite, tuple]:
    """The site a compiled graph would carry for ``recipe``'s attention, and its fresh state."""
    planner = Planner(recipe)
    site = DpaSite("attn", 0, (1, HEADS, 128, HEAD_DIM), (1, HEADS, 128, HEAD_DIM), (1, HEADS, 128, HEAD_DIM))
    quantizers = {slot: planner.quantizer(site.role(slot)) for slot in SLOTS}
    states = tuple(
        torch.cat(q.initial_state(torch.device(device))) if q.keeps_state else None for q in quantizers.values()
    )
    return AttentionSite(name="attn", call=0, **{slot: q.spec for slot, q in quantizers.items()}), states


def runs(seq: int, causal: bool, backward: bool) -> dict[str, callable]:
    batch = max(1, TOKENS // seq)
    q, k, v = (
        torch.randn(batch, HEADS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=backward) for _ in range(3)
    )
    grad = torch.randn_like(q)

    def step(attend):
        def run():
            out = attend(q, k, v)
            if backward:
                torch.autograd.grad(out, (q, k, v), grad)

        return run

    fns = {}
    for name, backend in BACKENDS.items():
        def attend(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        fns[name] = step(attend)
    for name, recipe in RECIPES.items():
        site, states = attention_site(recipe)
        fns[name] = step(lambda q, k, v, site=site, states=states: quantized_attention(q, k, v, is_causal=causal, site=site, states=states))
    return fns


def flops(seq: int, causal: bool, backward: bool) -> float:
    batch = max(1, TOKENS // seq)
    forward = 4 * batch * HEADS * seq * seq * HEAD_DIM
    return forward * (3.5 if backward else 1.0) / (2 if causal else 1)


def measure(fns: dict, rounds: int) -> dict[str, str]:
    """Each function's median ms, or why it could not run (OOM, no such backend here)."""
    results, usable = {}, {}
    for name, fn in fns.items():
        try:
            fn()
            torch.cuda.synchronize()
            usable[name] = fn
        except torch.OutOfMemoryError:
            results[name] = "OOM"
        except RuntimeError as error:  # a backend that does not take these inputs on this GPU
            results[name] = f"n/a ({str(error).splitlines()[0][:60]})"
        torch.cuda.empty_cache()
    results.update(alternate(usable, rounds=rounds, warmup=1, reps=3))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", default="2048,8192,16384", help="sequence lengths, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per configuration")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    rows = []
    for seq in map(int, args.seqs.split(",")):
        for causal in (False, True):
            for backward in (False, True):
                results = measure(runs(seq, causal, backward), args.rounds)
                work = flops(seq, causal, backward)
                for name, ms in results.items():
                    tflops = f"{work / ms / 1e9:.0f}" if isinstance(ms, float) else ms
                    rows.append([seq, "causal" if causal else "full", "fwd+bwd" if backward else "fwd", name,
                                 f"{ms:.2f}" if isinstance(ms, float) else "", tflops])
    print(tabulate(rows, headers=["seq", "mask", "pass", "config", "ms", "TFLOP/s"], tablefmt="simple", disable_numparse=True))


if __name__ == "__main__":
    main()
