"""What the clamp in front of a traced FP8 cast costs on the GPU, idle and between FP8 GEMMs.

The reference casts as clamp(x, -max, max).to(fp8); on CUDA sm_89+ graphquant's Pass 4
(passes/saturating_cast.py) drops the clamp, since Triton's conversion saturates by itself. This
times a SwiGLU FFN's traced casts (h = silu(gate) * up with its transposed copy; the SwiGLU
backward's two gradients) at 16384x14336 bf16, compiled with the pass and without, two ways:
after an idle pause (boost clock) and between FP8 GEMMs as a training step runs them, where the
H200 sits at its 700 W limit with the SM clock near 1.4 GHz: a kernel whose instructions took less
time than its bytes at boost may no longer.

    python benchmarks/saturating_cast.py
"""

import statistics

import torch
import torch.nn.functional as F
from tabulate import tabulate

from graphquant.formats import per_tensor
from graphquant.passes.saturating_cast import SaturatingCast

M, DIM, HIDDEN = 16384, 4096, 14336
ROUNDS, GEMMS = 5, 6


def h_cast(dh, gate, up, scale):
    h = F.silu(gate) * up
    return [per_tensor.quantize(h, scale, "e4m3", transpose=t) for t in (False, True)]


def gradient_casts(dh, gate, up, scale):
    grads = torch.ops.aten.silu_backward(dh * up, gate), dh * F.silu(gate)
    return [per_tensor.quantize(g, scale, "e5m2", transpose=False) for g in grads]


def timed(fn, heat):
    """Microseconds of one call of ``fn``, alone on the GPU or between ``heat`` calls."""
    if heat is None:
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)
    else:
        heat()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    if heat is not None:
        heat()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    dh, gate, up = (torch.randn(M, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    scale = torch.tensor(100.0, device="cuda")
    a = torch.randn(M, DIM, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(HIDDEN, DIM, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")

    def heat():
        for _ in range(GEMMS):
            torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16)

    variants = {}
    for name, producer in (("h = silu(gate) * up, rowwise and transposed", h_cast), ("SwiGLU gradients", gradient_casts)):
        for label, options in (("clamp (torch.compile)", {}), ("no clamp (Pass 4)", {"post_grad_custom_post_pass": SaturatingCast()})):
            torch._dynamo.reset()
            compiled = torch.compile(producer, dynamic=False, options=options)
            compiled(dh, gate, up, scale)
            variants[(name, label)] = lambda compiled=compiled: compiled(dh, gate, up, scale)
    samples = {key: [] for key in variants}
    for warm in (None, heat):  # all idle samples first: two milliseconds after a GEMM the clock is still capped
        for _ in range(ROUNDS):
            for key, fn in variants.items():
                samples[key].append(timed(fn, warm))
    rows = [[*key, statistics.median(s[:ROUNDS]), statistics.median(s[ROUNDS:])] for key, s in samples.items()]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {M}x{HIDDEN} bf16, medians of {ROUNDS}")
    print(tabulate(rows, headers=["cast of", "compiled with", "idle (us)", f"between {GEMMS} FP8 GEMMs (us)"], floatfmt=".1f"))


if __name__ == "__main__":
    main()
