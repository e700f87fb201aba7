"""TFLOP/s of attention: bf16 F.scaled_dot_product_attention per backend torch offers, beside
graphquant's FP8 attention (graphquant.ops.attention, as a compiled graph calls it).

    python benchmarks/attention.py [--seqs 2048,8192,16384] [--passes fwd,fwd+bwd] [--kv-heads 32,8] [--rounds 3] [--emulated]
        [--gluon-stages 4,5,6] [--gluon-warp-specialize 0,1] [--gluon-operand-order 0,1] [--layouts contiguous,transposed]
        [--gluon-sections 1,2,4] [--profile compiled]

32 query heads of dim 128 over 32 key/value heads, and over 8 (grouped-query attention, the
shape of benchmarks/models.py's decoder layer), bf16, a batch of 16384 // seq sequences (16k
tokens), causal and not, forward alone and forward + backward. TFLOP/s count the products (4 b h
Lq Lk d forward, 2.5 times that backward) and a causal attention as half of those. Q, K and V are
contiguous (batch, heads, length, dim) tensors, or (``--layouts transposed``) views of (batch,
length, heads, dim) ones, as a model's projections reach attention after transpose(1, 2), the
output then merged back to (batch, length, heads * dim) as the model's output projection takes it
(so that the gradient arrives as a model's would, not as a compiled graph's output's). The FP8
rows are nvfp4_linear_fp8_dpa's attention formats (per-tensor FP8, s and dp delayed) on the
backend the plan picks here: on Hopper the FP8 flash forward (graphquant.kernels.triton_attention,
or its Gluon twin graphquant.kernels.gluon_attention where Triton has Gluon), Q, K and V quantized first,
and the FP8 flash backward (graphquant.kernels.triton_attention_backward, or its Gluon twin
graphquant.kernels.gluon_attention_backward, s and dp under delayed scaling as the zoo recipe's):
"compiled" as a model runs it (graphquant.compile of a module calling
F.scaled_dot_product_attention, Inductor around the ops), "eager" the op called from Python
(every small op of the quantizes and the delayed-scaling states launched one by one).
Each sample is one call issued behind one queued call, as a model's steady state issues them;
"host ms" is the host's time to issue it (where it comes near "ms", the host set the pace).
``--profile TEXT`` prints, for every row whose name contains TEXT, where one call's host and GPU
time go (common.profile: the host's functions, the CUDA kernels, the GPU's idle gaps and whether
a late launch made them). "fp8 flash kernel(s) alone" are the kernels on codes quantized
beforehand ("fp8 gluon flash kernels alone": the Gluon forward and backward, as the plan picks
them); ``--gluon-sections`` adds the Gluon kernels alone with their grids in sections of that
many heads (the default's, one, against others: ``--gluon-sections 1,2,4``);
``--gluon-stages`` adds the forward kernel's Gluon twin
(graphquant.kernels.gluon_attention: the same bits, the tensor cores overlapped with the softmax)
at those pipeline depths, warp-specialized or not (``--gluon-warp-specialize``), S's keys in operand
order or not (``--gluon-operand-order``; by default the mask's default order). ``--emulated``
adds the exact emulation of that recipe and of MXFP8, which materialises S and P (so it runs out
of memory first: such a row says "OOM").
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import sys

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import alternate, profile  # noqa: E402

import graphquant  # noqa: E402
from graphquant import factories, zoo  # noqa: E402
from graphquant.kernels import backends  # noqa: E402
from graphquant.ops.attention import SLOTS, AttentionSite, quantize_qkv, quantized_attention  # noqa: E402
from graphquant.ops.quantize import SlotState, quantize_tensor  # noqa: E402
from graphquant.passes.find_attention import DpaSite  # noqa: E402
from graphquant.passes.plan import Planner  # noqa: E402
from graphquant.quantizers import COLUMNWISE, ROWWISE, Float8CurrentScalingQuantizer  # noqa: E402
from graphquant.recipes import CustomRecipe  # noqa: E402

HEADS, HEAD_DIM, TOKENS = 32, 128, 16384  # the query heads
E4M3 = Float8CurrentScalingQuantizer(fp8_dtype="e4m3")  # the zoo recipe's qkv and the kernel alone's
BACKENDS = {
    "bf16 sdpa flash": SDPBackend.FLASH_ATTENTION,
    "bf16 sdpa cudnn": SDPBackend.CUDNN_ATTENTION,
    "bf16 sdpa efficient": SDPBackend.EFFICIENT_ATTENTION,
}
ZOO = zoo.recipe("nvfp4_linear_fp8_dpa")
EMULATED_RECIPES = {
    "graphquant fp8 emulated (nvfp4_linear_fp8_dpa)": ZOO,
    "graphquant mxfp8 emulated": CustomRecipe(factories.mxfp8_factory, fp8_dpa=True),
}


def attention_site(recipe: CustomRecipe, device: str = "cuda", planned: bool = False, seq: int = 128) -> tuple[AttentionSite, tuple]:
    """The site a compiled graph would carry for ``recipe``'s attention, its formats as the plan
    gives them (``planned``: on the backends the plan picks for ``device`` and ``seq`` tokens,
    else the emulation), and its fresh state."""
    shape = (1, HEADS, seq, HEAD_DIM)
    site = DpaSite("attn", 0, shape, shape, shape)
    plan = Planner(recipe).plan([], torch.device(device), training=True, attention=[site])
    quantizers = {slot: plan.quantizer(site.role(slot)) for slot in SLOTS}
    states = tuple(
        torch.cat(q.initial_state(torch.device(device))) if q.keeps_state else None for q in quantizers.values()
    )
    backend = backward = backends.GemmBackend(backends.ATTENTION_EMULATION)
    if planned:
        chosen = {g.gemm: g.backend for g in plan.gemms}
        backend, backward = chosen["qk"], chosen["dq"]
    formats = {slot: q.spec for slot, q in quantizers.items()}
    return AttentionSite(name="attn", call=0, **formats, backend=backend, backward_backend=backward), states


def flash_codes(q, k, v) -> tuple:
    """(Q codes, K codes, V^T codes, their scale_inv, the P scale): what the FP8 flash forward
    takes, quantized as the zoo recipe's qkv quantizes."""
    rows = {t: x.detach().reshape(-1, HEAD_DIM) for t, x in zip("QKV", (q, k, v))}
    made = quantize_qkv(rows, E4M3, {"Q": (ROWWISE,), "K": (ROWWISE,), "V": (COLUMNWISE,)}, SlotState(None, None, 0))
    q8, k8 = (made[t][ROWWISE].tensors[0].view(x.shape) for t, x in (("Q", q), ("K", k)))
    vt, scale_inv = made["V"][COLUMNWISE].tensors[0], made["Q"][ROWWISE].tensors[1]
    return q8, k8, vt, scale_inv, E4M3.scale_of_amax(torch.ones(1, device=q.device))


def flash_kernel_alone(q, k, v, causal: bool, config=None, forward=None):
    """The FP8 flash forward on Q, K and V quantized beforehand (its own time, no quantize):
    ``forward`` (None: triton_attention.forward; or gluon_attention.forward) in ``config`` (its
    kernel's configuration; None: that kernel's default)."""
    from graphquant.kernels import triton_attention

    forward = forward or triton_attention.forward
    codes = flash_codes(q, k, v)
    return lambda: forward(*codes, 1 / HEAD_DIM**0.5, causal, q.dtype, config=config)


def flash_kernels_alone(q, k, v, grad, causal: bool, config=None, gluon: bool = False, forward_config=None):
    """The FP8 flash forward then the FP8 flash backward on Q, K, V and dO quantized beforehand
    (their own time: no quantize, no transposes, no D); P's and dS's scales those of amaxes 1;
    the backward in ``config`` and the forward in ``forward_config`` (their kernels'
    configurations; None: the defaults). ``gluon``: the Gluon kernels
    (graphquant.kernels.gluon_attention and gluon_attention_backward), as the plan picks them on
    Hopper under either mask."""
    from graphquant.kernels import triton_attention, triton_attention_backward

    forward, backward = triton_attention.forward, triton_attention_backward.backward
    if gluon:
        from graphquant.kernels import gluon_attention, gluon_attention_backward

        forward, backward = gluon_attention.forward, gluon_attention_backward.backward
    q8, k8, vt, scale_inv, p_scale = flash_codes(q, k, v)
    e5m2 = Float8CurrentScalingQuantizer(fp8_dtype="e5m2")
    do_made, _ = quantize_tensor(grad.reshape(-1, HEAD_DIM), e5m2, (ROWWISE, COLUMNWISE), SlotState(None, None, 0))
    do8, dot8 = do_made[ROWWISE].tensors[0].view(q.shape), do_made[COLUMNWISE].tensors[0]
    forward = functools.partial(forward, q8, k8, vt, scale_inv, p_scale, 1 / HEAD_DIM**0.5, causal, q.dtype, config=forward_config)
    o, lse = forward()
    delta = (do8.float() * do_made[ROWWISE].tensors[1] * o.float()).sum(-1)
    ds_scale = e5m2.scale_of_amax(torch.ones(1, device=q.device))
    scales = torch.cat([x.reshape(1) for x in (scale_inv, do_made[ROWWISE].tensors[1], p_scale, 1 / p_scale, ds_scale, 1 / ds_scale)])
    transposed = lambda x: torch.ops.graphquant.transposed(x.reshape(-1, HEAD_DIM))  # noqa: E731
    codes = (q8, transposed(q8), k8, transposed(k8), vt.t().contiguous().view(k.shape), do8, dot8)
    backward = functools.partial(backward, *codes, lse, delta, scales, 1 / HEAD_DIM**0.5, causal, "e4m3", "e5m2", q.dtype, config)
    return lambda: (forward(), backward())


def merged_heads(o: torch.Tensor) -> torch.Tensor:
    """Attention's (batch, heads, length, dim) output as a model's output projection takes it,
    (batch, length, heads * dim)."""
    return o.transpose(1, 2).flatten(2)


class Attention(torch.nn.Module):
    """F.scaled_dot_product_attention of (batch, heads, length, dim) Q, K and V, its output's
    heads merged (``merged_heads``) where ``merge`` says: what graphquant.compile finds in a model."""

    def __init__(self, causal: bool, merge: bool):
        super().__init__()
        self.causal, self.merge = causal, merge

    def forward(self, q, k, v):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=q.shape[1] != k.shape[1])
        return merged_heads(o) if self.merge else o


def inputs(batch: int, seq: int, kv_heads: int, layout: str, backward: bool) -> tuple:
    """Q, K and V, (batch, heads, seq, HEAD_DIM) bf16: contiguous, or ``layout`` "transposed":
    views of (batch, seq, heads, HEAD_DIM) tensors; and the output's gradient, shaped as Q or
    (transposed) as its merged heads."""
    def tensor(heads):
        if layout == "contiguous":
            return torch.randn(batch, heads, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        return torch.randn(batch, seq, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    q, k, v, grad = (tensor(heads) for heads in (HEADS, kv_heads, kv_heads, HEADS))
    grad = grad if layout == "contiguous" else merged_heads(grad).contiguous()
    return (*(x.requires_grad_(backward) for x in (q, k, v)), grad)


def runs(seq: int, causal: bool, backward: bool, emulated: bool, kv_heads: int = HEADS, gluon_schedules: tuple = (),
         layout: str = "contiguous", gluon_sections: tuple = ()) -> dict[str, callable]:
    batch = max(1, TOKENS // seq)
    q, k, v, grad = inputs(batch, seq, kv_heads, layout, backward)

    merge = layout == "transposed"

    def step(attend, merges: bool = merge):  # the compiled module merges the heads itself, in its graph
        def run():
            out = attend(q, k, v)
            out = merged_heads(out) if merges else out
            if backward:
                torch.autograd.grad(out, (q, k, v), grad)

        return run

    fns = {}
    for name, backend in BACKENDS.items():
        def attend(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != HEADS)

        fns[name] = step(attend)
    # The earlier rows' models are done with: before torch 2.13 their compiles count against this one's recompile limit,
    # which at 2k, 8k and 16k both masks and passes it reached (graphquant raises rather than run attention unquantized).
    torch._dynamo.reset()
    fns["graphquant fp8 planned, compiled (nvfp4_linear_fp8_dpa)"] = step(graphquant.compile(Attention(causal, merge), ZOO), merges=False)
    sites = {f"graphquant fp8 planned, eager (nvfp4_linear_fp8_dpa): {{}}": attention_site(ZOO, planned=True, seq=seq)}
    if emulated:
        sites |= {name: attention_site(recipe) for name, recipe in EMULATED_RECIPES.items()}
    for name, (site, states) in sites.items():
        emulated_backward = site.backend.name in backends.ATTENTION_KERNELS and site.backward_backend.name not in backends.ATTENTION_KERNELS
        name = name.format(f"{site.backend}{', backward emulated' if backward and emulated_backward else ''}")
        fns[name] = step(lambda q, k, v, site=site, states=states: quantized_attention(q, k, v, is_causal=causal, site=site, states=states))
    if torch.cuda.get_device_capability()[0] == 9 and backends.HAS_TRITON:
        if backward:
            fns["fp8 flash kernels alone (codes given)"] = flash_kernels_alone(q, k, v, grad, causal)
            if backends.HAS_GLUON:
                fns["fp8 gluon flash kernels alone (codes given)"] = flash_kernels_alone(q, k, v, grad, causal, gluon=True)
        else:
            fns["fp8 flash kernel alone (codes given)"] = flash_kernel_alone(q, k, v, causal)
            for stages, specialized, order in gluon_schedules:
                from graphquant.kernels import gluon_attention

                config = gluon_attention.default_config(causal)
                config = dataclasses.replace(config, num_stages=stages, warp_specialize=specialized,
                                             operand_order=config.operand_order if order is None else order)
                name = (f"fp8 gluon flash kernel alone, {stages} stages{', warp-specialized' if specialized else ''}"
                        f"{'' if order is None else ', operand order' if order else ', key order'}")
                fns[name] = flash_kernel_alone(q, k, v, causal, config, gluon_attention.forward)
        for section in gluon_sections if backends.HAS_GLUON else ():
            fns |= gluon_grid_orders(q, k, v, grad, causal, backward, section)
    return fns


def gluon_grid_orders(q, k, v, grad, causal: bool, backward: bool, section: int) -> dict[str, callable]:
    """The Gluon kernels alone with their grids in sections of ``section`` heads
    (triton_attention.work_item; the default's: one)."""
    from graphquant.kernels import gluon_attention, gluon_attention_backward

    label = f"sections of {section} head{'s' if section > 1 else ''}"
    forward = dataclasses.replace(gluon_attention.default_config(causal), heads_a_section=section)
    if backward:
        config = gluon_attention_backward.GluonBackwardConfig(heads_a_section=section)
        return {f"fp8 gluon flash kernels alone, {label}": flash_kernels_alone(q, k, v, grad, causal, config, True, forward)}
    return {f"fp8 gluon flash kernel alone, {label}": flash_kernel_alone(q, k, v, causal, forward, gluon_attention.forward)}


def flops(seq: int, causal: bool, backward: bool) -> float:
    batch = max(1, TOKENS // seq)
    forward = 4 * batch * HEADS * seq * seq * HEAD_DIM
    return forward * (3.5 if backward else 1.0) / (2 if causal else 1)


def measure(fns: dict, rounds: int, host: dict) -> dict[str, str]:
    """Each function's median ms, or why it could not run (OOM, no such backend here); ``host``
    receives the host's median ms a call."""
    results, usable = {}, {}
    for name, fn in fns.items():
        try:
            fn()
            torch.cuda.synchronize()
            usable[name] = fn
        except torch.OutOfMemoryError:
            results[name] = "OOM"
        except RuntimeError as error:  # a backend that does not take these inputs on this GPU
            results[name] = f"n/a ({str(error).splitlines()[0][:60]})"
        torch.cuda.empty_cache()
    results.update(alternate(usable, rounds=rounds, warmup=1, reps=3, queued=1, host=host))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", default="2048,8192,16384", help="sequence lengths, comma-separated")
    parser.add_argument("--passes", default="fwd,fwd+bwd", help="fwd, fwd+bwd or both, comma-separated")
    parser.add_argument("--kv-heads", default="32,8", help="key/value heads (of 32 query heads), comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per configuration")
    parser.add_argument("--emulated", action="store_true", help="add the exact emulation's rows (slow; OOM first)")
    parser.add_argument("--gluon-stages", default="", help="add the Gluon forward's rows (graphquant.kernels.gluon_attention, "
                        "the Triton forward's bits) at these num_stages, comma-separated (forward only)")
    parser.add_argument("--gluon-warp-specialize", default="0", help="the Gluon rows' warp_specialize, 0 and/or 1")
    parser.add_argument("--layouts", default="contiguous", help="Q, K and V contiguous and/or transposed (views of "
                        "(batch, length, heads, dim) tensors), comma-separated")
    parser.add_argument("--profile", default="", help="profile one call of every row whose name contains this text (stderr)")
    parser.add_argument("--gluon-operand-order", default="", help="the Gluon rows' operand_order, 0 and/or 1 (default: the mask's default)")
    parser.add_argument("--gluon-sections", default="", help="add the Gluon kernels alone with their grids in sections of these "
                        "numbers of heads (triton_attention.work_item; the default's: 1), comma-separated")
    args = parser.parse_args()
    passes = args.passes.split(",")
    if not set(passes) <= {"fwd", "fwd+bwd"}:
        parser.error(f"--passes takes fwd and fwd+bwd, got {args.passes!r}")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    rows = []
    cases = itertools.product(args.layouts.split(","), map(int, args.kv_heads.split(",")), map(int, args.seqs.split(",")), (False, True),
                              [p == "fwd+bwd" for p in passes])
    stages = [int(x) for x in args.gluon_stages.split(",") if x]
    flags = lambda text: [bool(int(x)) for x in text.split(",") if x]  # noqa: E731
    gluon_schedules = tuple(itertools.product(stages, flags(args.gluon_warp_specialize), flags(args.gluon_operand_order) or [None]))
    sections = tuple(int(x) for x in args.gluon_sections.split(",") if x)
    for layout, kv_heads, seq, causal, backward in cases:
        host, fns = {}, runs(seq, causal, backward, args.emulated, kv_heads, gluon_schedules, layout, sections)
        results = measure(fns, args.rounds, host)
        for name in [name for name in fns if args.profile and args.profile in name and name in host]:
            profile(f"{layout} {seq} {'causal' if causal else 'full'} {'fwd+bwd' if backward else 'fwd'}: {name}", fns[name])
        work = flops(seq, causal, backward)
        for name, ms in results.items():
            tflops = f"{work / ms / 1e9:.0f}" if isinstance(ms, float) else ms
            rows.append([layout, f"{HEADS}/{kv_heads}", seq, "causal" if causal else "full", "fwd+bwd" if backward else "fwd", name,
                         f"{ms:.2f}" if isinstance(ms, float) else "", f"{host[name]:.2f}" if name in host else "", tflops])
            print(" | ".join(map(str, rows[-1])), flush=True)  # as measured: a run cut short keeps its rows
    headers = ["layout", "heads/kv", "seq", "mask", "pass", "config", "ms", "host ms", "TFLOP/s"]
    print(tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True))


if __name__ == "__main__":
    main()
