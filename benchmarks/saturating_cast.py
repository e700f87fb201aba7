"""What the clamp in front of a traced FP8 cast costs on the GPU, idle and between FP8 GEMMs.

The reference casts as clamp(x, -max, max).to(fp8); on CUDA sm_89+ graphquant's Pass 4
(passes/saturating_cast.py) drops the clamp, since Triton's conversion saturates by itself. This
times a SwiGLU FFN's traced casts (h = silu(gate) * up with its transposed copy; the SwiGLU
backward's two gradients) at 16384x14336 bf16, compiled with the pass and without, two ways:
after an idle pause (boost clock) and between FP8 GEMMs as a training step runs them, where the
GPU sits at its power limit with the SM clock capped: a kernel whose instructions took less time
than its bytes at boost may no longer.

    python benchmarks/saturating_cast.py
"""

import torch
import torch.nn.functional as F
from common import idle_and_capped_us
from tabulate import tabulate

from graphquant.formats import per_tensor
from graphquant.passes.saturating_cast import SaturatingCast

M, DIM, HIDDEN = 16384, 4096, 14336
ROUNDS = 5


def h_cast(dh, gate, up, scale):
    h = F.silu(gate) * up
    return [per_tensor.quantize(h, scale, "e4m3", transpose=t) for t in (False, True)]


def gradient_casts(dh, gate, up, scale):
    grads = torch.ops.aten.silu_backward(dh * up, gate), dh * F.silu(gate)
    return [per_tensor.quantize(g, scale, "e5m2", transpose=False) for g in grads]


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    dh, gate, up = (torch.randn(M, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    scale = torch.tensor(100.0, device="cuda")
    variants = {}
    for name, producer in (("h = silu(gate) * up, rowwise and transposed", h_cast), ("SwiGLU gradients", gradient_casts)):
        for label, options in (("clamp (torch.compile)", {}), ("no clamp (Pass 4)", {"post_grad_custom_post_pass": SaturatingCast()})):
            torch._dynamo.reset()
            compiled = torch.compile(producer, dynamic=False, options=options)
            compiled(dh, gate, up, scale)
            variants[(name, label)] = lambda compiled=compiled: compiled(dh, gate, up, scale)
    rows = [[*key, idle, capped] for key, (idle, capped) in idle_and_capped_us(variants, ROUNDS).items()]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {M}x{HIDDEN} bf16, medians of {ROUNDS}")
    print(tabulate(rows, headers=["cast of", "compiled with", "idle (us)", "between 6 FP8 GEMMs (us)"], floatfmt=".1f"))


if __name__ == "__main__":
    main()
