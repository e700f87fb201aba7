"""Quantizing attention's Q, K and V for the FP8 flash forward: the joint reference against the
two passes of graphquant::joint_amax and graphquant::joint_cast (graphquant.ops.attention.flash_qkv).

    python benchmarks/attention_qkv.py [--seqs 8192,16384] [--reps 10] [--layouts contiguous,transposed]

32 heads of dim 128, bf16, 16k tokens per call (as benchmarks/attention.py), Q, K and V
contiguous (batch, heads, length, dim) tensors or ("transposed") views of (batch, length, heads,
dim) ones, as a model's projections reach attention; per-tensor E4M3 current scaling (the zoo
recipe's qkv), then delayed scaling (its scale known before the pass: one pass). Rows:
quantize_qkv eager (rows made by reshape, concatenate, amax, cast, then V transposed: what the
flash path ran before), the same under torch.compile (what Inductor makes of it inside a compiled
graph), and flash_qkv on the 4-D tensors. "ms" is one call from an idle GPU, the host's time
included; "GPU ms" the replay of one call captured in a CUDA graph, the kernels alone. "bound ms"
is the time of the bytes the passes must move (Q, K, V read twice under current scaling, once
under delayed; their codes and V's transposed codes written once) at the device copy's 4.0 TB/s
(design.md); GB/s are those bytes over "GPU ms". Each row's codes are checked against the eager
reference's.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

import torch
from tabulate import tabulate

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from attention import E4M3, HEAD_DIM, HEADS, TOKENS, inputs  # noqa: E402
from common import time_ms  # noqa: E402

from graphquant.ops.attention import flash_qkv, quantize_qkv  # noqa: E402
from graphquant.ops.quantize import SlotState  # noqa: E402
from graphquant.quantizers import COLUMNWISE, ROWWISE, Float8DelayedScalingQuantizer  # noqa: E402

DIRECTIONS = {"Q": (ROWWISE,), "K": (ROWWISE,), "V": (ROWWISE, COLUMNWISE)}


DELAYED = Float8DelayedScalingQuantizer(fp8_dtype="e4m3", amax_history_len=1, amax_compute_algo="most_recent")
QUANTIZERS = {"current": E4M3, "delayed": DELAYED}
COPY_BYTES_PER_MS = 4.0e9  # the device copy's bandwidth (design.md)


def _state(quantizer) -> SlotState:
    """A fresh slot: a delayed-scaling one as a later step finds it (scale 448 / 4), made on the
    device without a copy from the host (which would wait for the GPU inside a timed call)."""
    if not quantizer.keeps_state:
        return SlotState(None, None, 0)
    delayed = torch.full((2,), 4.0, device="cuda")
    delayed[0] = 112.0
    return SlotState(delayed, None, 0)


def joint(q, k, v, quantizer=E4M3):
    rows = {t: x.reshape(-1, HEAD_DIM) for t, x in zip("QKV", (q, k, v))}
    made = quantize_qkv(rows, quantizer, DIRECTIONS, _state(quantizer))
    return [op.tensors[0] for t in "QKV" for op in made[t].values()]


def two_passes(q, k, v, quantizer=E4M3):
    made = flash_qkv({"Q": q, "K": k, "V": v}, quantizer, _state(quantizer))
    return [op.tensors[0] for t in "QKV" for op in made[t].values()]


def graph_ms(fn: Callable[[], object], reps: int) -> Optional[float]:
    """GPU milliseconds of one call of ``fn`` (called before, so compiled): replays of the call
    captured in a CUDA graph, no host time; None where the call cannot be captured."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        torch.cuda.synchronize()
        return None
    return time_ms(graph.replay, warmup=3, reps=reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", default="8192,16384")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--layouts", default="contiguous,transposed", help="contiguous and/or transposed, comma-separated")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    rows = []
    compiled = torch.compile(joint, dynamic=False)
    for layout in args.layouts.split(","):
        for seq in map(int, args.seqs.split(",")):
            q, k, v, _ = inputs(max(1, TOKENS // seq), seq, HEADS, layout, False)
            elements = 3 * q.numel()
            for scaling, quantizer in QUANTIZERS.items():
                reads = 2 if scaling == "current" else 1
                floor = elements * (2 * reads + 1) + v.numel()  # bytes: bf16 read, codes written, V^T written
                reference = joint(q, k, v, quantizer)
                for name, fn in (("quantize_qkv eager (joint)", joint), ("quantize_qkv torch.compile (joint)", compiled),
                                 ("flash_qkv (joint_amax + joint_cast)" if scaling == "current" else "flash_qkv (joint_cast)", two_passes)):
                    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(fn(q, k, v, quantizer), reference))
                    ms = time_ms(lambda: fn(q, k, v, quantizer), warmup=3, reps=args.reps)
                    gpu = graph_ms(lambda: fn(q, k, v, quantizer), args.reps)
                    rows.append([layout, seq, scaling, name, f"{ms:.3f}", "n/a" if gpu is None else f"{gpu:.3f}",
                                 f"{floor / COPY_BYTES_PER_MS:.3f}", "" if gpu is None else f"{floor / gpu / 1e6:.0f}", "yes" if same else "NO"])
            del q, k, v
            torch.cuda.empty_cache()
    headers = ["layout", "seq", "scaling", "quantize", "ms", "GPU ms", "bound ms", "GB/s", "reference's codes"]
    print(tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True))


if __name__ == "__main__":
    main()
