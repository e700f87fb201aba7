"""The Gluon FP8 flash kernels alone beside copies of them from another revision, in alternating
rounds on the same codes, and whether their outputs are the same bits.

    mkdir -p base && for m in gluon_attention gluon_attention_backward; do
        git show REV:graphquant/kernels/$m.py > base/$m.py; done
    python benchmarks/attention_ab.py --baseline base [--seqs 2048,8192,16384] [--masks full,causal]
        [--passes fwd,bwd] [--rounds 5]

On the GPU machine, which has no git, the copies travel as an ignored folder (run's ``carry``). A
pass whose module the folder lacks is skipped. The copies import the rest of graphquant as it is
now, so a change to a shared helper (triton_attention, triton_attention_backward) is on both
sides: copy the kernels' modules from the revision whose helpers they call. 32 heads of dim 128 over
32 key/value heads, 16k tokens a call (as attention.py); "fwd" the forward on Q, K and V^T codes,
"bwd" the backward on the codes of tests/test_triton_attention.py's ``backward_arguments``.
"Same bits": O and the logsumexp, or dK, dV and dS's amax (dQ's tiles meet in no fixed order:
its largest difference instead).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from common import alternate  # noqa: E402

HEADS, HEAD_DIM, TOKENS = 32, 128, 16384
MODULES = {"fwd": "gluon_attention", "bwd": "gluon_attention_backward"}


def baseline_module(folder: str, name: str):
    """``folder``/``name``.py as a module of its own (registered before it runs: its dataclasses
    look their module up), or None where the folder has no such file."""
    path = os.path.join(folder, f"{name}.py")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location(f"baseline_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def forward_codes(seq: int) -> tuple:
    """Q, K and V^T E4M3 codes of TOKENS // seq sequences, their scale_inv and P's scale."""
    g = torch.Generator().manual_seed(0)
    q, k, v = ((torch.randn(TOKENS // seq, HEADS, seq, HEAD_DIM, generator=g) * 2).to(torch.float8_e4m3fn).cuda() for _ in range(3))
    return q, k, v.reshape(-1, HEAD_DIM).t().contiguous(), torch.tensor([0.05], device="cuda"), torch.tensor([448.0], device="cuda")


def calls(pass_: str, seq: int, causal: bool, modules: dict) -> tuple[dict, callable]:
    """Each side's call of ``pass_`` on the same codes, and what compares their outputs."""
    if pass_ == "fwd":
        codes = forward_codes(seq)
        fns = {side: (lambda m=m: m.forward(*codes, HEAD_DIM**-0.5, causal, torch.bfloat16)) for side, m in modules.items()}
        return fns, lambda a, b: f"O, lse same bits: {all(_same(x, y) for x, y in zip(a, b))}"
    from test_triton_attention import backward_arguments

    args = (*backward_arguments(TOKENS // seq, HEADS, HEADS, seq, seq, HEAD_DIM, causal), HEAD_DIM**-0.5, causal, "e4m3", "e5m2", torch.bfloat16)
    fns = {side: (lambda m=m: m.backward(*args)) for side, m in modules.items()}
    return fns, lambda a, b: (f"dK, dV, amax same bits: {all(_same(x, y) for x, y in zip(a[1:], b[1:]))}; "
                              f"dQ differs by {(a[0] - b[0]).abs().max().item():.1e}")


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()]
    return x.dtype == y.dtype and torch.equal(x.view(bits), y.view(bits))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, help="a folder of gluon_attention.py and/or gluon_attention_backward.py copies")
    parser.add_argument("--seqs", default="2048,8192,16384", help="sequence lengths, comma-separated")
    parser.add_argument("--masks", default="full,causal", help="full and/or causal, comma-separated")
    parser.add_argument("--passes", default="fwd,bwd", help="fwd and/or bwd, comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    args = parser.parse_args()
    from graphquant.kernels import gluon_attention, gluon_attention_backward

    now = {"fwd": gluon_attention, "bwd": gluon_attention_backward}
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    rows = []
    for pass_ in args.passes.split(","):
        base = baseline_module(args.baseline, MODULES[pass_])
        if base is None:
            print(f"{pass_}: no {MODULES[pass_]}.py in {args.baseline}, skipped", flush=True)
            continue
        for seq in map(int, args.seqs.split(",")):
            for mask in args.masks.split(","):
                fns, compare = calls(pass_, seq, mask == "causal", {"baseline": base, "now": now[pass_]})
                outputs = {side: fn() for side, fn in fns.items()}
                torch.cuda.synchronize()
                ms = alternate(fns, rounds=args.rounds, warmup=1, reps=3, queued=1)
                rows.append([pass_, seq, mask, f"{ms['baseline']:.3f}", f"{ms['now']:.3f}", f"{ms['baseline'] / ms['now']:.3f}x",
                             compare(outputs["baseline"], outputs["now"])])
                print(" | ".join(map(str, rows[-1])), flush=True)
                del fns, outputs
                torch.cuda.empty_cache()
    print(tabulate(rows, headers=["pass", "seq", "mask", "baseline ms", "now ms", "now x baseline", "outputs"], tablefmt="simple",
                   disable_numparse=True))


if __name__ == "__main__":
    main()
