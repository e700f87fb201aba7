"""The kernels of one forward of the inference sweep's FFN (two Llama-3-8B SwiGLU blocks) at a
few rows, per configuration: each kernel's name, launches and GPU microseconds, their sum, and the
span from the first kernel's start to the last one's end (the gaps between kernels are the
difference), so that a decode step's time can be split between GEMMs and the work around them.

    python benchmarks/decode_profile.py [--configs NAME,...] [--rows 1,16] [--cudagraphs]

Without --cudagraphs each launch's host time shows as gaps; with it, the replayed graph's.
"""

from __future__ import annotations

import argparse
import collections

import torch
from tabulate import tabulate

import inference_configs
from models import FeedForward

DEFAULT_CONFIGS = "bf16 torch.compile,graphquant tensorwise frozen,graphquant rowwise frozen,graphquant deepseek_blockwise frozen"


def kernels(model: torch.nn.Module, x: torch.Tensor) -> tuple[list[tuple[str, int, float]], float]:
    """(name, launches, GPU us) of each kernel of one forward, and the us from the first kernel's
    start to the last one's end."""
    for _ in range(3):
        model(x)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        model(x)
        torch.cuda.synchronize()
    launches = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in launches:
        by_name[e.name][0] += 1
        by_name[e.name][1] += e.time_range.elapsed_us()
    span = max(e.time_range.end for e in launches) - min(e.time_range.start for e in launches) if launches else 0.0
    return [(name, count, us) for name, (count, us) in by_name.items()], span


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS)
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--cudagraphs", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    rows = [int(r) for r in args.rows.split(",")]
    model = torch.nn.Sequential(FeedForward(), FeedForward()).to(device, torch.bfloat16)
    names = args.configs.split(",")
    inference_configs.allow_graphs(len(names) * len(rows) * 2)
    with torch.no_grad():
        for name in names:
            built = inference_configs.build(name, model, device, args.cudagraphs)
            for r in rows:
                found, span = kernels(built, torch.randn(r, model[0].w1.in_features, device=device, dtype=torch.bfloat16))
                busy = sum(us for _, _, us in found)
                print(f"\n{name} @{r} rows: {sum(c for _, c, _ in found)} launches, {busy:.1f} us on the GPU, span {span:.1f} us")
                print(tabulate(sorted(((n[:110], c, f"{us:.1f}") for n, c, us in found), key=lambda row: -float(row[2])),
                               headers=["kernel", "launches", "us"], disable_numparse=True), flush=True)


if __name__ == "__main__":
    main()
