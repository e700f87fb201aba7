"""How fast Inductor runs the per-tensor FP8 quantize that graphquant traces into a SwiGLU FFN.

Current scaling needs two passes over a tensor that Inductor fuses into its producer: an amax
reduction, then the cast (rowwise and transposed copies). This prints both for the FFN's largest
tensors (16384x14336 bf16): h = silu(gate) * up in the forward, and its two gradients in the
backward, with the amax taken flat (``x.abs().amax()``, a split reduction) or by rows first
(``graphquant.formats.fp8.tensor_amax``), under Inductor's default kernel configs and under its
coordinate-descent tuning. GB/s counts the bytes each kernel must move.

    python benchmarks/inductor_quantize.py
"""

import torch
import torch.nn.functional as F
from common import time_ms
from tabulate import tabulate

from graphquant.formats import fp8

M, N = 16384, 14336
TILE_BYTES = M * N * 2  # one bf16 (M, N) tensor


def swiglu_grads(dh, gate, up):
    return torch.ops.aten.silu_backward(dh * up, gate), dh * F.silu(gate)


def flat_amax(x):
    return x.abs().amax().float()


def forward_amax(amax):
    return lambda gate, up: amax(F.silu(gate) * up)


def backward_amax(amax):
    return lambda dh, gate, up: tuple(amax(g) for g in swiglu_grads(dh, gate, up))


def backward_cast(dh, gate, up, scale):
    """Both gradients as E5M2, rowwise and transposed: the four copies their GEMMs read."""
    copies = []
    for g in swiglu_grads(dh, gate, up):
        data = fp8.cast_to_fp8(g.float() * scale, "e5m2")
        copies += [data, data.t().contiguous()]
    return copies


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    dh, gate, up = (torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    scale = torch.tensor(3.0, device="cuda")
    cases = [
        ("forward amax, flat", forward_amax(flat_amax), (gate, up), 2 * TILE_BYTES),
        ("forward amax, rows first", forward_amax(fp8.tensor_amax), (gate, up), 2 * TILE_BYTES),
        ("backward amax, flat", backward_amax(flat_amax), (dh, gate, up), 3 * TILE_BYTES),
        ("backward amax, rows first", backward_amax(fp8.tensor_amax), (dh, gate, up), 3 * TILE_BYTES),
        ("backward cast, 4 copies", backward_cast, (dh, gate, up, scale), 3 * TILE_BYTES + 2 * TILE_BYTES),
    ]
    copy_us = time_ms(lambda: dh.clone()) * 1e3
    rows = [["device-to-device copy", "eager", copy_us, 2 * TILE_BYTES / copy_us / 1e3]]
    for configs, options in (("default", {}), ("coordinate descent", {"coordinate_descent_tuning": True})):
        for name, fn, args, nbytes in cases:
            torch._dynamo.reset()
            compiled = torch.compile(fn, options=options)
            us = time_ms(lambda: compiled(*args)) * 1e3
            rows.append([name, configs, us, nbytes / us / 1e3])
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(tabulate(rows, headers=["kernel", "Inductor configs", "us", "GB/s"], floatfmt=".1f"))


if __name__ == "__main__":
    main()
