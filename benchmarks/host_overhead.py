"""Host microseconds per call of the ops a per-tensor FP8 linear runs, layer by layer.

    python benchmarks/host_overhead.py

A compiled graph calls graphquant's custom ops; each call passes through torch.library's
dispatch, graphquant's Python (representations, backend selection) and the native launch. On a
model whose GPU work per step is short, those host microseconds become the step time
(``train_step.py --profile`` compares a step's host time with its GPU time). Every row
times ``calls`` back-to-back calls on tensors small enough that the GPU never
holds the host back; rows of one op go from the full op down to its bare launch, and the torch
calls that do the same work in torchao's graph stand beside them.
"""

from __future__ import annotations

import time

import torch
from tabulate import tabulate

from graphquant.kernels import backends, native
from graphquant.formats import fp8
from graphquant.quantizers import ROWWISE, Float8CurrentScalingQuantizer, QuantizeContext

M, N, K = 256, 512, 512


def host_us(fn, calls: int = 500) -> float:
    """Median over 5 samples of the host's microseconds per call (the GPU drained before each)."""
    for _ in range(20):
        fn()
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return sorted(samples)[2]


# The cheapest op both ways torch.library registers one: torch.library.custom_op (Python wrappers
# around every call) and the dispatcher API (as graphquant.ops.registry registers graphquant's ops).
@torch.library.custom_op("gqbench::clone", mutates_args=())
def clone_op(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


_BENCH = torch.library.Library("gqbench", "FRAGMENT")
_BENCH.define("dispatched_clone(Tensor x) -> Tensor")
_BENCH.impl("dispatched_clone", lambda x: x.clone(), "CompositeExplicitAutograd")


def main() -> None:
    if native.extension() is None:
        raise SystemExit("graphquant._C has no CUDA kernels: build it first (pip install --no-build-isolation -e .)")
    quantizer = Float8CurrentScalingQuantizer("e4m3")
    spec = quantizer.spec
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    ctx = QuantizeContext()
    a = native.quantize_pass(quantizer, x, ctx, columnwise=False).rowwise
    b = native.quantize_pass(quantizer, w, ctx, columnwise=False).rowwise
    ext = native.extension()
    amax = x.abs().amax().float()
    fp8_max = fp8.fp8_max("e4m3")
    backend = backends.select(quantizer, ROWWISE, quantizer, ROWWISE, x.device, (M, N, K), 1, True).backend

    def gemm_op():
        return torch.ops.graphquant.gemm(
            list(a.tensors()), spec, ROWWISE, (M, K), list(b.tensors()), spec, ROWWISE, (N, K), 1, torch.bfloat16,
            backend.name, backend.fast_accumulation, "fc#0 fprop",
        )

    rows = [
        ("op floor", "custom_op clone", lambda: clone_op(x)),
        ("op floor", "dispatcher-API clone", lambda: torch.ops.gqbench.dispatched_clone(x)),
        ("op floor", "Tensor.clone", lambda: x.clone()),
        ("gemm", "graphquant::gemm", gemm_op),
        ("gemm", "backends.gemm", lambda: backends.gemm(a, b, 1, torch.bfloat16, backend, "fc#0 fprop")),
        ("gemm", "backends.select", lambda: backends.select(quantizer, ROWWISE, quantizer, ROWWISE, x.device, (M, N, K), 1, True)),
        ("gemm", "_C.fp8_gemm", lambda: ext.fp8_gemm(a.data, b.data, a.scale.reshape(()), b.scale.reshape(()), torch.bfloat16, True, None)),
        ("gemm", "torch._scaled_mm", lambda: torch._scaled_mm(a.data, b.data.t(), a.scale.reshape(()), b.scale.reshape(()), out_dtype=torch.bfloat16, use_fast_accum=True)),
        ("quantize", "graphquant::quantize", lambda: torch.ops.graphquant.quantize(w, spec, True, True, None, None, 0)),
        ("quantize", "native.quantize_pass", lambda: native.quantize_pass(quantizer, w, ctx)),
        ("scales", "graphquant::fp8_scales", lambda: torch.ops.graphquant.fp8_scales(amax, "e4m3", 0.0, False)),
        ("scales", "torch ops (torchao's)", lambda: fp8_max / torch.clamp(amax, min=1e-12)),
        ("transpose", "graphquant::transposed", lambda: torch.ops.graphquant.transposed(a.data)),
        ("transpose", "Tensor.t().contiguous()", lambda: a.data.t().contiguous()),
    ]
    table = [(op, path, f"{host_us(fn):.1f}") for op, path, fn in rows]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; tensors {M}x{K} and {N}x{K}")
    print(tabulate(table, headers=["op", "called as", "host us / call"]))


if __name__ == "__main__":
    main()
