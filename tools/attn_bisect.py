"""Bisect the non-finite gradients of tests/test_triton_attention.py::test_compiled_decoder_trains_with_the_flash_kernels
(H200 only): the test's scenario (seeded decoder block, dim 128, 2 heads of 64, 2 x 256 tokens, causal,
zoo nvfp4_linear_fp8_dpa, graphquant.compile with aot_eager, two steps) under variants of the FP8 flash
kernels, each in its own process (Triton caches a kernel by its source), five at a time.

Every backward call is checked against graphquant.ops.attention.flash_attention_backward_reference on the
same inputs (which tensor is non-finite, at which (batch, head, row), the worst difference relative to the
reference's largest value), every forward call's outputs for non-finite values, and after each step every
parameter whose gradient went non-finite in that step. With --save DIR (default $OUT/attn-fix where $OUT is
set) the inputs of every backward call of the first variant are saved there, to replay on the CPU.

    python tools/attn_bisect.py                 # every variant
    python tools/attn_bisect.py --variant clamp  # one, in this process
    python tools/attn_bisect.py --joint          # the joint cast kernel alone, row count specialized or not
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VARIANTS = {  # the most telling first: a run cut short keeps them
    "quiet": "the branch as it is, nothing checked inside the steps (the checks synchronize the device)",
    "branch": "the branch as it is",
    "main-bwd+plain-logits": "main's backward and main's forward logits (main's attention kernels: does main pass?)",
    "reference-bwd": "the backward op's reference in place of the kernel (control: is the kernel the cause?)",
    "main-bwd": "main's two-kernel backward (tools/attn_bisect_main_backward.py) with the branch's forward",
    "plain-logits": "the forward scales the logits, then subtracts (as main's), no FMA",
    "clamp": "the P and dS casts clamp before the cast again (as main's)",
    "stages1": "BackwardConfig(num_stages=1): no software pipelining of the query loops",
    "kernel-dq": "the kernel's dQ, the reference's dK, dV and dS amax",
    "kernel-dkdv": "the kernel's dK and dV, the reference's dQ and dS amax",
    "kernel-amax": "the kernel's dS amax, the reference's dQ, dK, dV",
    "sync": "torch.cuda.synchronize() before and after the backward kernel",
    "eager-backend": "graphquant.compile(backend='eager'): the autograd formula run as Python, not traced by AOT autograd",
    "stages2": "BackwardConfig(num_stages=2)",
    "stagger": "BackwardConfig(stagger=True)",
}


def _variant_module(name: str, source: str, replacements: list[tuple[str, str]]):
    """The module of ``source`` with each (old, new) replaced once (each must be there), written to
    a file (Triton reads a kernel's source from its file) and imported as ``name``."""
    import importlib.util

    for old, new in replacements:
        assert source.count(old) == 1, f"{name}: {old!r} found {source.count(old)} times"
        source = source.replace(old, new)
    path = os.path.join(tempfile.mkdtemp(prefix="attn_bisect_"), f"{name}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def _override(op: str, fn, key: str) -> None:
    """graphquant::``op``'s kernel for dispatch ``key`` replaced by ``fn`` (the registry registered one already)."""
    import torch
    import torch.library

    from graphquant.ops import registry

    torch.library._impls.discard(f"graphquant/{op}/{key}")
    library = torch.library.Library("graphquant", "IMPL")
    library.impl(op, registry._untracked(fn), key)
    _override.keep = getattr(_override, "keep", []) + [library]


def _where(bad, shape) -> str:
    """The first few (batch, head, row) of the True entries of ``bad`` (batch, heads, rows, D)."""
    import torch

    idx = torch.nonzero(bad.reshape(shape[0], shape[1], shape[2], -1).any(-1))[:4].tolist()
    return str([tuple(i) for i in idx])


def run_variant(variant: str, seeds: list[int], save: str | None, device: str) -> None:
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import graphquant
    import models
    from graphquant import zoo
    from graphquant.kernels import backends

    if device == "cpu":  # Triton's interpreter (TRITON_INTERPRET=1) on a pretended Hopper, its FP8 casts the reference's
        import test_triton_attention

        exec(test_triton_attention.INTERPRETER_SETUP, {})
        backends.capability = lambda device: (9, 0)
        backends.HAS_TRITON = True
        backends.clear_caches()
    from graphquant.kernels import triton_attention, triton_attention_backward
    from graphquant.ops import attention

    forward, backward = triton_attention.forward, triton_attention_backward.backward
    if variant in ("plain-logits", "main-bwd+plain-logits"):
        fwd_module = _variant_module("attn_bisect_fwd", _read("graphquant/kernels/triton_attention.py"), [
            ("        s = tl.dot(q, tl.trans(k))\n", "        s = tl.dot(q, tl.trans(k)) * qk_scale\n"),
            ("tl.maximum(m_i, tl.max(s, 1) * qk_scale)", "tl.maximum(m_i, tl.max(s, 1))"),
            ("tl.math.exp2(s * qk_scale - m_new[:, None])", "tl.math.exp2(s - m_new[:, None])"),
        ])
        forward = fwd_module.forward
    if variant.startswith("main-bwd"):
        backward = _variant_module("attn_bisect_main_bwd", _read("tools/attn_bisect_main_backward.py"), []).backward
    if variant == "clamp":
        backward = _variant_module("attn_bisect_bwd", _read("graphquant/kernels/triton_attention_backward.py"), [(
            '    return (x * scale).to(CODE, fp_downcast_rounding="rtne")\n',
            "    y = x * scale\n"
            "    if CODE == tl.float8e4nv:\n"
            "        y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))\n"
            "    else:\n"
            "        y = tl.where(y > 57344.0, 57344.0, tl.where(y < -57344.0, -57344.0, y))\n"
            '    return y.to(CODE, fp_downcast_rounding="rtne")\n',
        )]).backward
    configs = {"stages1": {"num_stages": 1}, "stages2": {"num_stages": 2}, "stagger": {"stagger": True}}
    if variant in configs:
        triton_attention_backward.DEFAULT_CONFIG = triton_attention_backward.BackwardConfig(**configs[variant])

    calls = {"fwd": 0, "bwd": 0}

    def checked_forward(*args):
        o, lse, p_amax = forward(*args)
        calls["fwd"] += 1
        print(f"  fwd call {calls['fwd']}: o non-finite {(~o.isfinite()).sum().item()}, lse non-finite "
              f"{(~lse.isfinite()).sum().item()}, p_amax {p_amax.item():.6g}, scale_inv {args[3].item():.6g}", flush=True)
        return o, lse, p_amax

    def checked_backward(*args):
        calls["bwd"] += 1
        q, qt, k, kt, v, do, dot, lse, delta, scales = args[:10]
        if save and calls["bwd"] <= 4:
            os.makedirs(save, exist_ok=True)
            torch.save([a.cpu() if isinstance(a, torch.Tensor) else a for a in args], os.path.join(save, f"bwd_call{calls['bwd']}.pt"))
        if variant == "sync" and device == "cuda":
            torch.cuda.synchronize()
        got = list(backward(*args)) if variant != "reference-bwd" else list(attention.flash_attention_backward_reference(*args))
        if variant == "sync" and device == "cuda":
            torch.cuda.synchronize()
        ref = attention.flash_attention_backward_reference(*args)
        print(f"  bwd call {calls['bwd']}: scales [qkv_inv, do_inv, s, s_inv, dp, dp_inv] = {[f'{x:.6g}' for x in scales.tolist()]}, "
              f"lse non-finite {(~lse.isfinite()).sum().item()}, delta non-finite {(~delta.isfinite()).sum().item()} "
              f"(|delta| max {delta.abs().max().item():.3g}), |do codes| max {do.float().abs().max().item():.3g}", flush=True)
        for name, a, r in zip(("dQ", "dK", "dV"), got[:3], ref[:3]):
            bad, rbad = ~a.isfinite(), ~r.isfinite()
            diff = (a - r).abs().nan_to_num(float("inf")).max().item() / max(r.abs().nan_to_num(0).max().item(), 1e-30)
            print(f"    {name}: non-finite {bad.sum().item()} (NaN {a.isnan().sum().item()}) at (b, h, row) {_where(bad, a.shape)}; reference non-finite "
                  f"{rbad.sum().item()}; max |kernel - reference| / max |reference| {diff:.3g}; |kernel| max "
                  f"{a.abs().nan_to_num(0).max().item():.3g}", flush=True)
        print(f"    dS amax: kernel {got[3].item():.6g}, reference {ref[3].item():.6g}", flush=True)
        if variant == "kernel-dq":
            got = [got[0], *ref[1:]]
        elif variant == "kernel-dkdv":
            got = [ref[0], got[1], got[2], ref[3]]
        elif variant == "kernel-amax":
            got = [*ref[:3], got[3]]
        return tuple(got)

    key = "CUDA" if device == "cuda" else "CPU"
    if variant != "quiet":
        _override("flash_attention", checked_forward, key)
        _override("flash_attention_backward", checked_backward, key)
    elif device == "cpu":
        _override("flash_attention", forward, key)
        _override("flash_attention_backward", backward, key)

    for seed in seeds:
        torch.manual_seed(seed)
        model = models.seeded(models.DecoderBlock(dim=128, n_heads=2, attention="sdpa")).to(device)
        x = torch.randn(2, 256, 128, device=device)
        compiled = graphquant.compile(model, zoo.recipe("nvfp4_linear_fp8_dpa"), backend="eager" if variant == "eager-backend" else "aot_eager")
        before = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for step in (1, 2):
            loss = compiled(x).square().mean()
            loss.backward()
            bad = []
            for n, p in model.named_parameters():
                g = p.grad - before[n]
                if not g.isfinite().all():
                    bad.append(f"{n} ({(~g.isfinite()).sum().item()}/{g.numel()})")
                before[n] = p.grad.clone()
            print(f"seed {seed} step {step}: loss {loss.item():.6g}; non-finite gradients: {', '.join(bad) or 'none'}", flush=True)
        print(f"RESULT {variant} seed {seed}: {'FINITE' if all(p.grad.isfinite().all() for p in model.parameters()) else 'NON-FINITE'}", flush=True)


def check_joint_cast(device: str) -> None:
    """graphquant::joint_cast's Triton kernel as it is and with its row count specialized again
    (as it was), on float32 and bfloat16 tensors of 1024 and 70 rows, against the op's reference:
    how many codes differ, in which rows of the transposed codes."""
    import torch

    import graphquant  # noqa: F401  (registers the ops)
    from graphquant.kernels import triton_joint_fp8

    source = _read("graphquant/kernels/triton_joint_fp8.py")
    specialized = _variant_module("attn_bisect_joint", source, [('@triton.jit(do_not_specialize=["rows"])', "@triton.jit")])
    for name, module in (("as it is", triton_joint_fp8), ("rows specialized", specialized)):
        for dtype in (torch.float32, torch.bfloat16):
            for rows in (1024, 70):
                for fp8_dtype in ("e4m3", "e5m2"):
                    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
                    scale = torch.tensor(448.0 / x.float().abs().max().item() if fp8_dtype == "e4m3" else 57344.0 / x.float().abs().max().item())
                    expected = torch.ops.graphquant.joint_cast([x], scale, fp8_dtype, [True])
                    got = module.joint_cast([x.to(device)], scale.to(device), fp8_dtype, [True])
                    row_bad = (got[0][0].cpu().view(torch.uint8) != expected[0][0].view(torch.uint8)).sum().item()
                    t_bad = got[1][0].cpu().view(torch.uint8) != expected[1][0].view(torch.uint8)
                    print(f"joint_cast {name}: {dtype} {rows} rows {fp8_dtype}: rowwise codes wrong {row_bad}, transposed codes wrong "
                          f"{t_bad.sum().item()} in rows {t_bad.any(1).nonzero().flatten().tolist()}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=list(VARIANTS), help="run one variant in this process")
    parser.add_argument("--joint", action="store_true", help="only check the joint cast kernel, specialized on its row count or not")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="the variants to run, each in a process")
    parser.add_argument("--seeds", default="0,1", help="x's seeds (the test draws x unseeded)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: under TRITON_INTERPRET=1")
    parser.add_argument("--jobs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=90, help="seconds a variant may take")
    parser.add_argument("--deadline", type=float, default=140, help="seconds for them all: none starts later than 30 s before")
    parser.add_argument("--save", default=os.path.join(os.environ["OUT"], "attn-fix") if os.environ.get("OUT") else None)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.joint:
        check_joint_cast(args.device)
        return
    if args.variant:
        run_variant(args.variant, seeds, args.save, args.device)
        return
    names = args.variants.split(",")
    running, done, begin = {}, {}, time.time()
    while names or running:
        if time.time() - begin > args.deadline - 30:
            names.clear()
        while names and len(running) < args.jobs:
            name = names.pop(0)
            command = [sys.executable, __file__, "--variant", name, "--seeds", args.seeds, "--device", args.device]
            if args.save and name == "branch":
                command += ["--save", args.save]
            running[name] = time.time(), subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                             env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
        for name, (start, process) in list(running.items()):
            if process.poll() is not None or time.time() - start > args.timeout or time.time() - begin > args.deadline:
                if process.poll() is None:
                    process.kill()
                out = process.communicate()[0]
                print(f"===== {name}: {VARIANTS[name]} (exit {process.returncode}, {time.time() - start:.0f} s)\n{out}", flush=True)
                done[name] = [line for line in out.splitlines() if line.startswith("RESULT")]
                del running[name]
        time.sleep(0.5)
    print("===== summary")
    for name, results in done.items():
        print(f"{name}: {'; '.join(r.split(': ', 1)[1] for r in results) or 'no result (see its output)'}")


if __name__ == "__main__":
    main()
