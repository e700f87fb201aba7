"""Quantizing attention's Q, K and V for the FP8 flash forward: the joint reference against the
two passes of graphquant::joint_amax and graphquant::joint_cast (graphquant.ops.attention.flash_qkv).

    python benchmarks/attention_qkv.py [--seqs 8192,16384] [--reps 10]

32 heads of dim 128, bf16, 16k tokens per call (as benchmarks/attention.py); per-tensor E4M3
current scaling (the zoo recipe's qkv), then delayed scaling (its scale known before the pass:
one pass). Rows: quantize_qkv eager (concatenate, amax, cast, then V transposed: what the flash
path ran before), the same under torch.compile (what Inductor makes of it inside a compiled
graph), and flash_qkv. GB/s count the bytes current scaling's two passes must move (Q, K, V read
twice, their codes and V's transposed codes written once), so a row's GB/s is that floor's
bandwidth at its time. Each row's codes are checked against the eager reference's.
"""

from __future__ import annotations

import argparse
import sys

import torch
from tabulate import tabulate

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from attention import E4M3, HEAD_DIM, HEADS, TOKENS  # noqa: E402
from common import time_ms  # noqa: E402

from graphquant.ops.attention import flash_qkv, quantize_qkv  # noqa: E402
from graphquant.ops.quantize import SlotState  # noqa: E402
from graphquant.quantizers import COLUMNWISE, ROWWISE, Float8DelayedScalingQuantizer  # noqa: E402

DIRECTIONS = {"Q": (ROWWISE,), "K": (ROWWISE,), "V": (ROWWISE, COLUMNWISE)}


DELAYED = Float8DelayedScalingQuantizer(fp8_dtype="e4m3", amax_history_len=1, amax_compute_algo="most_recent")
QUANTIZERS = {"current": E4M3, "delayed": DELAYED}


def _state(quantizer) -> SlotState:
    """A fresh slot: a delayed-scaling one as a later step finds it (scale 448 / 4)."""
    return SlotState(torch.tensor([112.0, 4.0], device="cuda") if quantizer.keeps_state else None, None, 0)


def joint(q, k, v, quantizer=E4M3):
    made = quantize_qkv({"Q": q, "K": k, "V": v}, quantizer, DIRECTIONS, _state(quantizer))
    return [op.tensors[0] for t in "QKV" for op in made[t].values()]


def two_passes(q, k, v, quantizer=E4M3):
    made = flash_qkv({"Q": q, "K": k, "V": v}, quantizer, _state(quantizer))
    return [op.tensors[0] for t in "QKV" for op in made[t].values()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", default="8192,16384")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    rows = []
    compiled = torch.compile(joint, dynamic=False)
    for seq in map(int, args.seqs.split(",")):
        n = max(1, TOKENS // seq) * HEADS * seq
        q, k, v = (torch.randn(n, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        floor = 3 * n * HEAD_DIM * (2 * 2 + 1) + n * HEAD_DIM  # bytes: read twice, codes once, V^T once
        for scaling, quantizer in QUANTIZERS.items():
            reference = joint(q, k, v, quantizer)
            for name, fn in (("quantize_qkv eager (joint)", joint), ("quantize_qkv torch.compile (joint)", compiled),
                             ("flash_qkv (joint_amax + joint_cast)" if scaling == "current" else "flash_qkv (joint_cast)", two_passes)):
                same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(fn(q, k, v, quantizer), reference))
                ms = time_ms(lambda: fn(q, k, v, quantizer), warmup=3, reps=args.reps)
                rows.append([seq, scaling, name, f"{ms:.3f}", f"{floor / ms / 1e6:.0f}", "yes" if same else "NO"])
        del q, k, v
        torch.cuda.empty_cache()
    headers = ["seq", "scaling", "quantize", "ms", "two-pass floor GB/s", "reference's codes"]
    print(tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True))


if __name__ == "__main__":
    main()
