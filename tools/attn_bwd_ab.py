"""The FP8 flash backward at the decoder layer's attention (benchmarks/models.py: 32 query heads
over 8 key/value heads of dim 128, batch 2 x 8192 tokens) and without groups, causal and full:
main's kernel (tools/attn_bwd_main_kernel.py), the program per (key tile, query head) on a
(key tiles, heads) grid (tools/attn_bwd_grid2d_kernel.py) and on the branch's one-dimensional
grid, beside cuDNN's bf16 backward. The two copies are kept for this A/B only.

    python tools/attn_bwd_ab.py [--reps 5] [--workers 5] [--rounds 2]

Compiles every (variant, case) in --workers processes first, then times the backward alone
(codes, logsumexp and D made beforehand) and checks each variant's dQ, dK, dV against main's
(the largest difference over the largest |value|: atomics make the last bits vary)."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import multiprocessing
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from attention import HEAD_DIM, HEADS, TOKENS, flash_codes, flops  # noqa: E402
from common import alternate  # noqa: E402

from graphquant.kernels import triton_attention, triton_attention_backward as new  # noqa: E402
from graphquant.ops.quantize import SlotState, quantize_tensor  # noqa: E402
from graphquant.quantizers import COLUMNWISE, ROWWISE, Float8CurrentScalingQuantizer  # noqa: E402

SEQ = 8192
DEVICE = os.environ.get("AB_DEVICE", "cuda")  # "cpu" under TRITON_INTERPRET=1: a dry run of the inputs and kernels
CASES = [(8, True), (8, False), (32, True), (32, False)]  # (kv heads, causal)
VARIANTS = ["main", "per query head, (key tiles, heads) grid", "per query head, one-dimensional grid"]
MODULES = {"main": "attn_bwd_main_kernel", "per query head, (key tiles, heads) grid": "attn_bwd_grid2d_kernel"}


@functools.cache
def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inputs(kv_heads: int, seq: int, causal: bool):
    batch = max(1, TOKENS // seq)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(batch, HEADS, seq, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(batch, kv_heads, seq, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    grad = torch.randn_like(q)
    q8, k8, vt, scale_inv, p_scale = flash_codes(q, k, v)
    o, lse, _ = triton_attention.forward(q8, k8, vt, scale_inv, p_scale, 1 / HEAD_DIM**0.5, causal, q.dtype)
    e5m2 = Float8CurrentScalingQuantizer(fp8_dtype="e5m2")
    do_made, _ = quantize_tensor(grad.reshape(-1, HEAD_DIM), e5m2, (ROWWISE, COLUMNWISE), SlotState(None, None, 0))
    do8, dot8 = do_made[ROWWISE].tensors[0].view(q.shape), do_made[COLUMNWISE].tensors[0]
    delta = (do8.float() * do_made[ROWWISE].tensors[1] * o.float()).sum(-1)
    ds_scale = e5m2.scale_of_amax(torch.ones(1, device=DEVICE))
    scales = torch.cat([x.reshape(1) for x in (scale_inv, do_made[ROWWISE].tensors[1], p_scale, 1 / p_scale, ds_scale, 1 / ds_scale)])
    transposed = lambda x: torch.ops.graphquant.transposed(x.reshape(-1, HEAD_DIM))  # noqa: E731
    codes = (q8, transposed(q8), k8, transposed(k8), vt.t().contiguous().view(k.shape), do8, dot8)
    return (*codes, lse, delta, scales, 1 / HEAD_DIM**0.5, causal, "e4m3", "e5m2"), (q, k, v, grad)


def _run(name, args):
    module = _module(MODULES[name]) if name in MODULES else new
    return lambda: module.backward(*args)


def _compile(job) -> str:
    name, kv_heads, causal = job
    try:
        args, _ = _inputs(kv_heads, 128, causal)
        _run(name, args)()
        torch.cuda.synchronize()
        return ""
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:100]}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workers", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    jobs = [(name, kv, causal) for kv, causal in CASES for name in VARIANTS]
    started = time.time()
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        failed = {job: why for job, why in zip(jobs, pool.map(_compile, jobs, chunksize=1)) if why}
    print(f"compiled {len(jobs)} in {time.time() - started:.0f} s; failed: {failed}", flush=True)
    for kv, causal in CASES:
        kernel_args, (q, k, v, grad) = _inputs(kv, SEQ, causal)
        names = [n for n in VARIANTS if (n, kv, causal) not in failed]
        fns = {n: _run(n, kernel_args) for n in names}
        reference = fns["main"]() if "main" in fns else None
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=kv != HEADS)
            torch.autograd.grad(out, leaves, grad)

        def cudnn_fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=kv != HEADS)

        fns |= {"bf16 cudnn fwd+bwd": cudnn, "bf16 cudnn fwd": cudnn_fwd}
        ms = alternate(fns, rounds=args.rounds, warmup=1, reps=args.reps, inner=2)
        bwd_flops = flops(SEQ, causal, True) - flops(SEQ, causal, False)
        cudnn_bwd = ms["bf16 cudnn fwd+bwd"] - ms["bf16 cudnn fwd"]
        print(f"\n== {HEADS}/{kv} heads, batch {TOKENS // SEQ} x {SEQ}, {'causal' if causal else 'full'}: backward ms (TFLOP/s), x cuDNN's bwd", flush=True)
        print(f"  {'bf16 cudnn bwd (fwd+bwd - fwd)':42s} {cudnn_bwd:7.3f} ({bwd_flops / cudnn_bwd / 1e9:4.0f})  cudnn fwd {ms['bf16 cudnn fwd']:.3f}")
        for n in names:
            check = ""
            if reference is not None and n != "main":
                got = fns[n]()
                check = "  diff/max " + " ".join(f"{((a - b).abs().max() / b.abs().max()).item():.1e}" for a, b in zip(got[:3], reference[:3]))
                check += f" ds_amax {'=' if torch.equal(got[3], reference[3]) else '!='}"
            print(f"  {n:42s} {ms[n]:7.3f} ({bwd_flops / ms[n] / 1e9:4.0f})  {cudnn_bwd / ms[n]:.2f}x{check}", flush=True)
        del fns, kernel_args, reference
        torch.cuda.empty_cache()
    print(f"done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
