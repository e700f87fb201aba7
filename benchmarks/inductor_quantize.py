"""How fast Inductor takes the per-tensor amax that graphquant traces into a SwiGLU FFN, by the
shape the reduction is written in.

Current scaling needs an amax pass over each quantized tensor before its cast; traced, Inductor
fuses it into the tensor's producer. max is exact in any order, so the reduction may be written in
any shape: flat (``x.abs().amax()``, a split reduction), by rows (``amax(-1)`` first), or over
the flat tensor cut into chunks of a fixed length (a persistent reduction where the chunk is
short), and as an integer max of the magnitudes' float32 bit patterns. This times each for the
FFN's quantized tensors: h = silu(gate) * up in the forward (16384x14336) and its two gradients
in the backward (graphquant's ``fp8.tensor_amax``, timed too, takes these rows in chunks of 1024
as bit patterns); the RMSNorm output, whose row reduction the amax can join, and a plain sum
(16384x4096, as the down projection's grad_output); and eight 14336x4096 weights in one call (one
weight's amax alone is shorter than a compiled call's host work). Each sample is one call,
timed after an idle pause (boost clock) and between FP8 GEMMs (the power-capped clock of a
training step). GB/s counts the bytes each amax must read, at the capped clock.

    python benchmarks/inductor_quantize.py [--coordinate-descent]
"""

import argparse

import torch
import torch.nn.functional as F
from common import idle_and_capped_us, time_ms
from tabulate import tabulate

from graphquant.formats import fp8

M, DIM, HIDDEN = 16384, 4096, 14336
CHUNKS = (128, 256, 512, 1024, 4096)


def flat(x):
    return x.abs().amax().float()


def rows(x):
    return x.abs().amax(-1).amax().float()


def chunks_of(length):
    return lambda x: x.abs().reshape(-1, length).amax(-1).amax().float()


def magnitude_bits_chunks_of(length):
    """graphquant's fp8.tensor_amax of a bf16 x (an integer max of the magnitudes' float32 bit
    patterns, rounded to bf16 after the max) with x's rows in chunks of ``length``."""
    return lambda x: fp8.rounded_to_bfloat16(fp8.magnitude_bits(x).reshape(-1, length).amax(-1).amax()).view(torch.float32)


def swiglu_grads(dh, gate, up):
    return torch.ops.aten.silu_backward(dh * up, gate), dh * F.silu(gate)


def rms_norm(x, weight):
    """benchmarks/models.RMSNorm's forward."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    return normed.to(x.dtype) * weight


PRODUCERS = {
    # name: (the tensors an amax reads, given an amax function, and the shapes of its inputs)
    "h = silu(gate) * up": (lambda amax: lambda gate, up: amax(F.silu(gate) * up), [(M, HIDDEN)] * 2),
    "SwiGLU gradients": (lambda amax: lambda dh, gate, up: [amax(g) for g in swiglu_grads(dh, gate, up)], [(M, HIDDEN)] * 3),
    "RMSNorm output": (lambda amax: lambda x, weight: amax(rms_norm(x, weight)), [(M, DIM), (DIM,)]),
    "a + b": (lambda amax: lambda a, b: amax(a + b), [(M, DIM)] * 2),
    "8 weights 14336x4096": (lambda amax: lambda *weights: [amax(w) for w in weights], [(HIDDEN, DIM)] * 8),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coordinate-descent", action="store_true", help="compile with Inductor's coordinate-descent tuning")
    args = parser.parse_args()
    options = {"coordinate_descent_tuning": True} if args.coordinate_descent else {}
    amaxes = {"flat": flat, "rows": rows, **{f"chunks of {n}": chunks_of(n) for n in CHUNKS}}
    amaxes["bits, chunks of 512"] = magnitude_bits_chunks_of(512)
    amaxes["graphquant's fp8.tensor_amax (bits, chunks of 1024)"] = fp8.tensor_amax
    torch._dynamo.config.recompile_limit = 4 * len(amaxes)  # the variants share their producer's code object
    g = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    probe = torch.randn(M, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    copy_us = time_ms(lambda: probe.clone()) * 1e3
    rows_out.append(["device-to-device copy", "", copy_us, "", probe.numel() * 4 / copy_us / 1e3])
    for producer, (make, shapes) in PRODUCERS.items():
        inputs = [torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=g) for s in shapes]
        torch._dynamo.reset()  # each producer's variants share code objects: static shapes, own cache
        compiled = {name: torch.compile(make(amax), dynamic=False, options=options) for name, amax in amaxes.items()}
        fns = {name: lambda fn=fn: fn(*inputs) for name, fn in compiled.items()}
        for fn in fns.values():
            fn()
        nbytes = sum(x.numel() * x.element_size() for x in inputs)
        for name, (idle, capped) in idle_and_capped_us(fns).items():
            rows_out.append([producer, name, idle, capped, nbytes / capped / 1e3])
    configs = "coordinate-descent" if args.coordinate_descent else "default"
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, Inductor {configs} configs")
    print(tabulate(rows_out, headers=["amax of", "reduction", "idle us", "between GEMMs us", "GB/s"], floatfmt=".1f"))


if __name__ == "__main__":
    main()
