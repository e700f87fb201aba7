"""The FP8 flash-attention forward (graphquant.kernels.triton_attention) and how the plan runs it.

On the CPU: the selection and the plan (a Hopper capability pretended), the codes the kernel gets
(the emulation's, bit for bit), the backward that recomputes through the emulation (the kernel
stood in for by the emulation's own forward, so every gradient and state must match the
emulated op's bit for bit).

Against the emulation, within the bound derived in ``flash_bound``: on the GPU, and on the CPU
under Triton's interpreter.
"""

import dataclasses
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import graphquant
from graphquant import zoo
from graphquant.formats import fp8
from graphquant.kernels import backends
from graphquant.ops.attention import AttentionSite, quantize_qkv, quantized_attention
from graphquant.ops.quantize import SlotState, update_delayed_scaling
from graphquant.quantizers import COLUMNWISE, ROWWISE, Float8CurrentScalingQuantizer, IdentityQuantizer, MXFP8Quantizer
from graphquant.recipes import CustomRecipe

import models
from test_attention import CURRENT, DELAYED, MXFP8, ZOO, _states

FLASH = backends.GemmBackend(backends.FLASH_ATTENTION)
GLUON = backends.GemmBackend(backends.GLUON_FLASH_ATTENTION)
E4M3 = Float8CurrentScalingQuantizer(fp8_dtype="e4m3")
E4M3_ULP = 2.0**-3  # relative spacing of E4M3's normal values (3 mantissa bits)
E4M3_SUBNORMAL = 2.0**-9  # E4M3's smallest subnormal, the absolute spacing below 2^-6
E5M2_ULP = 2.0**-2  # relative spacing of E5M2's normal values (2 mantissa bits)
E5M2_SUBNORMAL = 2.0**-16  # E5M2's smallest subnormal
EPS32 = 2.0**-24  # fp32 unit roundoff


# -- selection and plan ------------------------------------------------------------------------

@pytest.fixture
def hopper(monkeypatch):
    """backends as it answers on an H200 with Triton (and its Gluon) installed (nothing worked out
    for another device kept, before or after)."""
    monkeypatch.setattr(backends, "capability", lambda device: (9, 0))
    monkeypatch.setattr(backends, "HAS_TRITON", True)
    monkeypatch.setattr(backends, "HAS_GLUON", True)
    backends.clear_caches()
    yield
    backends.clear_caches()


@pytest.fixture
def emulated_kernel():
    """graphquant::flash_attention and graphquant::gluon_flash_attention on the CPU as the
    emulation's own forward on the codes they get (and the logsumexp of its logits); the context it
    yields names the site and counts the calls (and those of the Gluon op alone), and those of
    graphquant::flash_attention_backward and graphquant::gluon_flash_attention_backward (their
    reference; those of the Gluon op alone too)."""
    from graphquant.ops import attention

    library = torch.library.Library("graphquant", "IMPL")
    context = {}

    def kernel(q, k, vt, scale_inv, p_scale, softmax_scale, causal, out_dtype, token_major):
        context["calls"] = context.get("calls", 0) + 1
        site = context.get("site", AttentionSite(name="attn", call=0, **CURRENT))
        b, h, lq, d = q.shape
        groups, lk = h // k.shape[1], k.shape[2]
        operand = lambda data, direction: attention.Operand([data, scale_inv, scale_inv], site.qkv, direction, (data.shape[0] if direction == ROWWISE else data.shape[1], d))  # noqa: E731
        grouped = lambda t: t.repeat_interleave(groups, 1).reshape(-1, d)  # noqa: E731
        vt_heads = vt.t().reshape(k.shape)
        made = {"Q": {ROWWISE: operand(q.reshape(-1, d), ROWWISE)}, "K": {ROWWISE: operand(grouped(k), ROWWISE)},
                "V": {COLUMNWISE: operand(grouped(vt_heads).t().contiguous(), COLUMNWISE)}}
        mask = attention._additive_mask(None, causal, lq, lk, q.device)
        o, _, _ = attention.emulated_forward(site, {"Q": torch.empty(0, dtype=out_dtype), "V": None}, made, mask, softmax_scale, (b, h, lq, lk), False)
        logits = (q.float() * scale_inv) @ (grouped(k).float() * scale_inv).view(b, h, lk, d).transpose(-1, -2) * softmax_scale
        lse = torch.logsumexp(logits if mask is None else logits + mask, -1)
        return backends.empty_attention(q.shape, out_dtype, q.device, token_major).copy_(o.view(b, h, lq, d)), lse

    def backward_kernel(*args):
        context["backward calls"] = context.get("backward calls", 0) + 1
        return attention.flash_attention_backward_reference(*args)

    def gluon_kernel(*args):
        context["gluon calls"] = context.get("gluon calls", 0) + 1
        return kernel(*args)

    def gluon_backward_kernel(*args):
        context["gluon backward calls"] = context.get("gluon backward calls", 0) + 1
        return backward_kernel(*args)

    library.impl("flash_attention", kernel, "CPU")
    library.impl("gluon_flash_attention", gluon_kernel, "CPU")
    library.impl("flash_attention_backward", backward_kernel, "CPU")
    library.impl("gluon_flash_attention_backward", gluon_backward_kernel, "CPU")
    yield context
    library._destroy()


def _select(*args, query_length: int = 128, key_length: int = 128) -> backends.Selection:
    """backends.select_attention for ``query_length`` queries and ``key_length`` keys (multiples of
    16 unless told)."""
    return backends.select_attention(*args, query_length=query_length, key_length=key_length)


def test_selection_on_hopper(hopper):
    cpu = torch.device("cpu")
    planned = graphquant.parse_spec(ZOO["s"])
    assert _select(cpu, E4M3, planned, (128, 128), False) == backends.Selection(backends.NATIVE, GLUON)
    assert _select(cpu, E4M3, E4M3, (64, 64), False).bucket == backends.NATIVE
    zoo = {slot: graphquant.parse_spec(spec) for slot, spec in ZOO.items()}
    backward = lambda **formats: _select(cpu, E4M3, formats.get("s", zoo["s"]), (64, 64), False, True, formats.get("do", zoo["do"]), formats.get("dp", zoo["dp"]))  # noqa: E731
    assert backward() == backends.Selection(backends.NATIVE, GLUON)
    assert backward(do=graphquant.parse_spec(DELAYED["do"])).bucket == backends.NATIVE
    assert backward(s=E4M3).bucket == backends.NATIVE  # P's scale is its bound's, whatever s's scaling
    refused_backward = {
        "per-tensor FP8 under delayed scaling dp, not fp8_current(fp8_dtype=e5m2)": {"dp": graphquant.parse_spec(CURRENT["dp"])},
        "per-tensor FP8 do, not mxfp8(fp8_dtype=e5m2)": {"do": graphquant.parse_spec(MXFP8["do"])},
    }
    for reason, formats in refused_backward.items():
        selection = backward(**formats)
        assert selection.bucket == backends.EMULATED and f"the FP8 flash backward takes {reason}: S and P recomputed" in selection.reason, selection
    refused = {
        "per-tensor E4M3 qkv, not mxfp8": (MXFP8Quantizer(), E4M3, (128, 128), False),
        "per-tensor E4M3 s, not fp8_current(fp8_dtype=e5m2)": (E4M3, Float8CurrentScalingQuantizer(fp8_dtype="e5m2"), (128, 128), False),
        "not an attn_mask": (E4M3, E4M3, (128, 128), True),
        "one head dim of (64, 128), not (96, 96)": (E4M3, E4M3, (96, 96), False),
        "one head dim of (64, 128), not (128, 64)": (E4M3, E4M3, (128, 64), False),
    }
    for reason, args in refused.items():
        selection = _select(cpu, *args)
        assert selection.bucket == backends.EMULATED and reason in selection.reason, selection


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_forward_and_the_backward_are_gluons(hopper, head_dim):
    """On Hopper where Triton has Gluon, an attention's forward products (causal or unmasked: the
    kernels take no other mask) run on the Gluon forward (the Triton forward's bits, faster there
    under either mask), the backward's on the Gluon backward."""
    cpu = torch.device("cpu")
    zoo = {slot: graphquant.parse_spec(spec) for slot, spec in ZOO.items()}
    formats = (zoo["qkv"], zoo["s"], (head_dim, head_dim), False)
    assert _select(cpu, *formats, key_length=2048) == backends.Selection(backends.NATIVE, GLUON)
    assert _select(cpu, *formats, True, zoo["do"], zoo["dp"], key_length=2048) == backends.Selection(backends.NATIVE, GLUON)


def test_the_triton_kernels_run_what_the_gluon_kernels_cannot(hopper, monkeypatch):
    """An unmasked attention whose key length is no multiple of 16, or on a Triton without Gluon,
    gets the Triton forward, with the reason; a backward whose query or key length is no multiple
    of 16, or on a Triton without Gluon, the Triton backward, with the reason."""
    cpu = torch.device("cpu")
    zoo = {slot: graphquant.parse_spec(spec) for slot, spec in ZOO.items()}
    backward = (zoo["qkv"], zoo["s"], (128, 128), False, True, zoo["do"], zoo["dp"])
    assert _select(cpu, E4M3, E4M3, (128, 128), False, key_length=100) == backends.Selection(
        backends.NATIVE, FLASH, "the Gluon forward takes key lengths that are multiples of 16, not 100"
    )
    for lengths, reason in (({"query_length": 100}, "query lengths that are multiples of 16, not 100"),
                            ({"key_length": 72}, "key lengths that are multiples of 16, not 72")):
        assert _select(cpu, *backward, **lengths) == backends.Selection(backends.NATIVE, FLASH, f"the Gluon backward takes {reason}")
    monkeypatch.setattr(backends, "HAS_GLUON", False)
    assert _select(cpu, E4M3, E4M3, (128, 128), False) == backends.Selection(
        backends.NATIVE, FLASH, "the Gluon forward needs Triton with Gluon (triton.experimental.gluon)"
    )
    assert _select(cpu, *backward) == backends.Selection(backends.NATIVE, FLASH, "the Gluon backward needs Triton with Gluon (triton.experimental.gluon)")


def test_selection_elsewhere(monkeypatch):
    """Off Hopper, or without Triton, no flash forward runs (the Gluon one neither, mask or not)."""
    cpu = torch.device("cpu")
    assert "runs on Hopper (sm_90), not cpu" in _select(cpu, E4M3, E4M3, (64, 64), False).reason
    monkeypatch.setattr(backends, "capability", lambda device: (10, 0))
    assert "not sm_100" in _select(cpu, E4M3, E4M3, (64, 64), False).reason
    monkeypatch.setattr(backends, "capability", lambda device: (9, 0))
    monkeypatch.setattr(backends, "HAS_TRITON", False)
    assert "needs Triton" in _select(cpu, E4M3, E4M3, (64, 64), False).reason


def _decoder():
    # causal, head dim 64; every linear has more features than the decode GEMM takes rows (a
    # wgrad's rows are its features)
    return models.seeded(models.DecoderBlock(dim=256, n_heads=4, hidden=256, attention="sdpa"))


def _unmasked_decoder():
    return models.seeded(models.DecoderBlock(dim=256, n_heads=4, hidden=256, attention="sdpa", causal=False))


def _decoder_input():
    """192 tokens: more rows than Triton's decode GEMM takes (128), which a pretended Hopper's plan
    would otherwise pick for the decoder's linears and which cannot run on the CPU."""
    return torch.randn(2, 96, 256)


def _current_dpa_recipe():
    """FP8 attention under current scaling everywhere: the flash forward, the emulated backward."""
    return CustomRecipe(lambda role: Float8CurrentScalingQuantizer(fp8_dtype="e4m3"), fp8_dpa=True)


def test_plan_shows_the_native_passes_and_the_graph_carries_them(hopper, emulated_kernel, tmp_path, monkeypatch):
    """Under the zoo recipe (s and dp delayed), where Triton has no Gluon, the plan lists every
    product on the Triton flash kernels; the rewritten graph's AttentionSite names them, and
    running it calls both kernels' ops. Under current-scaling s and dp the backward stays emulated,
    and the site says so."""
    monkeypatch.setattr(backends, "HAS_GLUON", False)
    x = _decoder_input()
    plan = graphquant.explain(_decoder(), zoo.recipe("nvfp4_linear_fp8_dpa"), x)
    rows = {g.gemm: (g.bucket, g.backend) for g in plan.gemms if g.module_type == "dpa"}
    assert rows == {gemm: (backends.NATIVE, FLASH) for gemm in ("qk", "pv", "dv", "dp", "dq", "dk")}
    assert backends.FLASH_ATTENTION in str(plan)
    compiled = graphquant.compile(_decoder(), zoo.recipe("nvfp4_linear_fp8_dpa"), backend="aot_eager", dump_dir=str(tmp_path))
    calls = dict(emulated_kernel)
    compiled(x).sum().backward()
    assert emulated_kernel["calls"] == calls.get("calls", 0) + 1 and emulated_kernel["backward calls"] == calls.get("backward calls", 0) + 1
    assert f"backend={FLASH!r}, backward_backend={FLASH!r}" in (tmp_path / "graph_000_rewritten.py").read_text()

    plan = graphquant.explain(_decoder(), _current_dpa_recipe(), x)
    emulation = backends.GemmBackend(backends.ATTENTION_EMULATION)
    assert {g.gemm: g.backend for g in plan.gemms if g.module_type == "dpa"} == {"qk": FLASH, "pv": FLASH, "dv": emulation, "dp": emulation, "dq": emulation, "dk": emulation}
    graphquant.compile(_decoder(), _current_dpa_recipe(), backend="aot_eager", dump_dir=str(tmp_path))(x).sum().backward()
    assert emulated_kernel["backward calls"] == calls.get("backward calls", 0) + 1
    assert f"backend={FLASH!r})" in (tmp_path / "graph_000_rewritten.py").read_text()


def test_plan_and_dump_name_the_gluon_forward_without_a_mask(hopper, emulated_kernel, tmp_path):
    """Without a mask, under the zoo recipe, the plan runs qk and pv on the Gluon forward and the
    backward's products on the Gluon backward; the dumped plan and rewritten graph say so, and the
    compiled graph calls the Gluon forward's op (not the Triton forward's) and the Gluon backward's."""
    compiled = graphquant.compile(_unmasked_decoder(), zoo.recipe("nvfp4_linear_fp8_dpa"), backend="aot_eager", dump_dir=str(tmp_path))
    backward_calls = emulated_kernel.get("gluon backward calls", 0)
    assert _forwards_run(emulated_kernel, compiled, _decoder_input()) == (0, 1)
    assert emulated_kernel["gluon backward calls"] == backward_calls + 1
    rows = {g.gemm: (g.bucket, g.backend, g.reason) for g in compiled.graphquant.plan.gemms if g.module_type == "dpa"}
    assert rows == {gemm: (backends.NATIVE, GLUON, "") for gemm in ("qk", "pv", "dv", "dp", "dq", "dk")}
    assert backends.GLUON_FLASH_ATTENTION in (tmp_path / "graph_000_plan.txt").read_text()
    assert f"backend={GLUON!r}, backward_backend={GLUON!r}" in (tmp_path / "graph_000_rewritten.py").read_text()


def _forwards_run(emulated_kernel, compiled, x) -> tuple[int, int]:
    """The flash forwards a training step of ``compiled`` on ``x`` calls: (the Triton one's, the Gluon one's)."""
    before = dict(emulated_kernel)
    compiled(x).sum().backward()
    gluon = emulated_kernel.get("gluon calls", 0) - before.get("gluon calls", 0)
    return emulated_kernel["calls"] - before.get("calls", 0) - gluon, gluon


def test_a_key_length_the_gluon_forward_refuses_runs_the_triton_forward(hopper, emulated_kernel):
    """Without a mask but with 100 keys (no multiple of 16), the plan gives the forward to the
    Triton kernel and says why, and the compiled graph runs it."""
    compiled = graphquant.compile(_unmasked_decoder(), _current_dpa_recipe(), backend="aot_eager", dynamic=False)
    assert _forwards_run(emulated_kernel, compiled, torch.randn(2, 100, 256)) == (1, 0)
    reason = "the Gluon forward takes key lengths that are multiples of 16, not 100"
    rows = {g.gemm: (g.backend, g.reason) for g in compiled.graphquant.plan.gemms if g.gemm in ("qk", "pv")}
    assert rows == {"qk": (FLASH, reason), "pv": (FLASH, reason)}


def test_the_forwards_choice_guards_a_dynamic_key_length(hopper, emulated_kernel):
    """Compiled for dynamic shapes (linears in high precision: no GEMM's test on the length), a
    graph planned on the Gluon forward for 96 keys is not reused for 100: they get a graph of their
    own, on the Triton forward, whose reason names the symbol; 112 keys reuse the first."""
    recipe = zoo.with_fp8_attention(CustomRecipe(lambda role: IdentityQuantizer()))
    compiled = graphquant.compile(_unmasked_decoder(), recipe, backend="aot_eager", dynamic=True)
    assert _forwards_run(emulated_kernel, compiled, torch.randn(2, 96, 256)) == (0, 1)
    assert _forwards_run(emulated_kernel, compiled, torch.randn(2, 100, 256)) == (1, 0)
    assert _forwards_run(emulated_kernel, compiled, torch.randn(2, 112, 256)) == (0, 1)
    first, second = ({g.gemm: g for g in plan.gemms if g.gemm in ("qk", "pv")} for plan in compiled.graphquant.plans)
    assert {g.backend for g in first.values()} == {GLUON} and {g.backend for g in second.values()} == {FLASH}
    assert re.fullmatch(r"the Gluon forward takes key lengths that are multiples of 16, not s\d+", second["qk"].reason), second["qk"].reason


def test_strict_rejects_the_emulated_backward(hopper, emulated_kernel):
    plan = graphquant.explain(_decoder(), _current_dpa_recipe(), _decoder_input(), strict=True)
    buckets = {g.gemm: g.bucket for g in plan.gemms if g.module_type == "dpa"}
    assert buckets == {"qk": "native", "pv": "native", "dv": "rejected", "dp": "rejected", "dq": "rejected", "dk": "rejected"}
    plan = graphquant.explain(_decoder(), zoo.recipe("nvfp4_linear_fp8_dpa"), _decoder_input(), strict=True)
    assert {g.bucket for g in plan.gemms if g.module_type == "dpa"} == {"native"}


# -- what the kernel is given, and the backward ------------------------------------------------

def _inputs(b=2, hq=4, hkv=2, lq=64, lk=64, d=64, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(b, h, n, d, generator=g) for h, n in ((hq, lq), (hkv, lk), (hkv, lk), (hq, lq)))
    return tuple(t.to(device=device, dtype=dtype) for t in (q * 2, k, v * 3, dout * 1e-3))


@pytest.mark.parametrize("backward", [FLASH, GLUON], ids=["triton", "gluon"])
def test_site_refuses_a_flash_backward_it_cannot_run(backward):
    for forward in (FLASH, GLUON):  # either backward after either forward
        AttentionSite(name="attn", call=0, **ZOO, backend=forward, backward_backend=backward)
    with pytest.raises(ValueError, match=r"attn#0: the FP8 flash backward cannot run this site \(the FP8 flash backward takes per-tensor FP8 under delayed scaling dp, not fp8_current\(fp8_dtype=e5m2\)\)"):
        AttentionSite(name="attn", call=0, **CURRENT, backend=FLASH, backward_backend=backward)
    with pytest.raises(ValueError, match=r"attn#0: the FP8 flash backward cannot run this site \(its forward does not run on a flash kernel\)"):
        AttentionSite(name="attn", call=0, **ZOO, backward_backend=backward)


def test_flash_site_refuses_a_mask():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=r"attn#0: the FP8 flash-attention kernel takes is_causal or no mask, not an attn_mask of shape \(64, 64\)"):
        quantized_attention(q, k, v, torch.ones(64, 64, dtype=torch.bool), site=AttentionSite(name="attn", call=0, **CURRENT, backend=FLASH))


def test_codes_are_the_emulations():
    """Quantized without repeating the key/value heads, Q, K and V get the emulation's scale and
    codes (it quantizes the repeated heads, which leave the joint amax alone), and V^T is the
    exact transpose of V's rowwise codes."""
    q, k, v, _ = _inputs()
    rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    state = SlotState(None, None, 0)
    flash = quantize_qkv({"Q": rows(q), "K": rows(k), "V": rows(v)}, E4M3, {"Q": (ROWWISE,), "K": (ROWWISE,), "V": (ROWWISE, COLUMNWISE)}, state)
    repeated = {"Q": rows(q), "K": rows(k.repeat_interleave(2, 1)), "V": rows(v.repeat_interleave(2, 1))}
    emulated = quantize_qkv(repeated, E4M3, {"Q": (ROWWISE,), "K": (ROWWISE,), "V": (COLUMNWISE,)}, state)
    codes = lambda op: op.tensors[0].view(torch.uint8)  # noqa: E731
    assert torch.equal(flash["Q"][ROWWISE].tensors[1], emulated["Q"][ROWWISE].tensors[1])
    assert torch.equal(codes(flash["Q"][ROWWISE]), codes(emulated["Q"][ROWWISE]))
    k_codes = codes(flash["K"][ROWWISE]).view(k.shape).repeat_interleave(2, 1).reshape(-1, 64)
    assert torch.equal(k_codes, codes(emulated["K"][ROWWISE]))
    assert torch.equal(codes(flash["V"][COLUMNWISE]), codes(flash["V"][ROWWISE]).t())


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("formats", ["current", "zoo"])
def test_backward_is_the_emulations(emulated_kernel, formats, causal, layout):
    """With the kernel's O equal to the emulation's, the flash path's gradients are the emulated
    op's bit for bit over two steps (grouped-query attention, causal and not), and so is every
    delayed-scaling state; also
    where Q, K, V and dO are (batch, heads, length, dim) views of (batch, length, heads, dim)
    tensors, which the flash path quantizes where they lie."""
    formats = {"current": CURRENT, "zoo": ZOO}[formats]
    emulated, flash = AttentionSite(name="attn", call=0, **formats), AttentionSite(name="attn", call=0, **formats, backend=FLASH)
    states = {site: _states(formats) for site in (emulated, flash)}
    for step in range(2):
        q, k, v, dout = _inputs(seed=step)
        if layout == "transposed":
            q, k, v, dout = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, dout))
        emulated_kernel.update(site=emulated)
        results = {}
        for site in (emulated, flash):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            o = quantized_attention(*leaves, is_causal=causal, site=site, states=states[site])
            results[site] = (o.detach(), *torch.autograd.grad(o, leaves, dout))
        for name, a, e in zip(("O", "dQ", "dK", "dV"), results[flash], results[emulated]):
            torch.testing.assert_close(a, e, rtol=0, atol=0, msg=lambda m: f"step {step} {name}: {m}")
        for slot, a, e in zip(("qkv", "s", "do", "dp"), states[flash], states[emulated]):
            if e is not None:
                torch.testing.assert_close(a, e, rtol=0, atol=0, msg=lambda m: f"step {step}, {slot}'s state: {m}")


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["heads", "grouped"])
def test_outputs_and_converted_gradients_lie_as_their_inputs(emulated_kernel, kv_heads):
    """Q, K and V viewed token by token (a model's projections transposed): the flash path's O lies
    token by token too, so that the model's transpose back is a view (and the gradient it gets back
    fits O without a copy), and so does each gradient converted from an fp32 sum (dQ; dK and dV
    under grouped-query attention); dK and dV the kernel writes in bf16 stay as written. Every value
    is that of contiguous inputs, bit for bit."""
    site = AttentionSite(name="attn", call=0, **ZOO, backend=FLASH, backward_backend=FLASH)
    q, k, v, dout = _inputs(hkv=kv_heads, dtype=torch.bfloat16)
    results = {}
    for layout in ("contiguous", "token-major"):
        if layout == "token-major":
            q, k, v, dout = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, dout))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = quantized_attention(*leaves, is_causal=True, site=site, states=_states(ZOO))
        results[layout] = (o, *torch.autograd.grad(o, leaves, dout))
    token_major = dict(zip(("O", "dQ", "dK", "dV"), (True, True, kv_heads != 4, kv_heads != 4)))
    for (name, laid_out), a, e in zip(token_major.items(), results["token-major"], results["contiguous"]):
        assert a.transpose(1, 2).is_contiguous() if laid_out else a.is_contiguous(), f"{name}: strides {a.stride()}"
        assert torch.equal(a, e), name


# -- the kernel under the Triton interpreter ---------------------------------------------------

# Triton's interpreter as the GPU runs a kernel: the setup every interpreted check starts with.
INTERPRETER_SETUP = textwrap.dedent(
    """
    import sys

    sys.path.insert(0, %r)
    import triton_interpreter

    triton_interpreter.accept_numpy_scalars()
    triton_interpreter.exact_fp8_dot_operands()
    triton_interpreter.round_fp8_to_nearest_even()
    """
) % os.path.dirname(os.path.abspath(__file__))
INTERPRETED = INTERPRETER_SETUP + textwrap.dedent(
    """
    sys.path.insert(0, %r)
    from graphquant.kernels import triton_attention
    from graphquant.ops import registry
    import test_triton_attention

    registry.LIBRARY.impl("flash_attention", triton_attention.forward, "CPU")
    for *shape, config in %r:
        config = config and triton_attention.ForwardConfig(**config)
        print(test_triton_attention.check_against_the_emulation(*shape, device="cpu", config=config))
    """
)


def test_kernel_under_the_interpreter():
    """The GPU test's comparison with the kernel run by Triton's interpreter on the CPU (the
    reference's float32 -> E4M3 cast in place of the interpreter's): grouped heads, lengths that
    are not multiples of the tiles (one query row, more queries than keys, several key tiles),
    causal and not, both head dims; and configurations other than the default: key tiles wider
    than the query block (the causal loop's end inside a key tile), PV promoted within a tile;
    QK^T a tile ahead (whose bits are those of the same configuration without it), and S's keys in
    the PV operand's order."""
    pytest.importorskip("triton")
    other = {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 2, "pv_promotion": 32}
    ahead = {"block_m": 64, "block_n": 64, "pv_promotion": 64, "qk_ahead": True}
    ordered = {"block_m": 64, "block_n": 128, "qk_ahead": True, "operand_order": True}
    shapes = [(1, 2, 1, 130, 70, 64, False, None), (1, 2, 1, 130, 70, 64, True, None), (2, 2, 2, 1, 200, 64, False, None),
              (1, 4, 2, 150, 300, 128, True, None), (1, 2, 1, 200, 200, 64, True, other), (1, 2, 2, 70, 300, 128, False, other),
              (1, 2, 1, 200, 200, 64, True, ahead), (1, 2, 2, 70, 300, 128, False, ahead),
              (1, 2, 1, 200, 200, 64, True, ordered), (1, 2, 2, 70, 300, 128, False, ordered)]
    tests = os.path.dirname(__file__)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", INTERPRETED % (tests, shapes)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


# -- Q, K and V quantized for the kernel ---------------------------------------------------------

def _qkv_inputs(dtype=torch.bfloat16, device="cpu", seed=0, rows=(130, 70, 70)):
    """2-D Q, K and V of head dim 64 (by default row counts that do not tile), with a largest
    value in V."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, 64, generator=g) * s for n, s in zip(rows, (2.0, 1.0, 3.0)))
    v[3, 5] = -40.0
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


@pytest.mark.parametrize("layout", ["rows", "heads"])
@pytest.mark.parametrize("qkv", ["current", "pow2", "delayed"])
def test_flash_qkv_is_quantize_qkv(qkv, layout):
    """flash_qkv (graphquant::joint_amax and joint_cast, nothing joined) gives quantize_qkv's
    codes, scale_inv and amax of the rows bit for bit, V's columnwise codes the transpose of its
    rowwise ones, and a delayed-scaling slot the same state after it; so does joint_per_tensor for
    one tensor both ways (the flash backward's dO) against quantize_tensor; from 2-D rows, and
    from (batch, heads, length, dim) views of (batch, length, heads, dim) tensors."""
    from graphquant.ops.attention import flash_qkv, joint_per_tensor
    from graphquant.ops.quantize import quantize_tensor
    from graphquant.quantizers import Float8DelayedScalingQuantizer

    quantizer = {
        "current": E4M3, "pow2": Float8CurrentScalingQuantizer(fp8_dtype="e4m3", force_pow_2_scales=True, amax_epsilon=1e-3),
        "delayed": Float8DelayedScalingQuantizer(fp8_dtype="e4m3", amax_history_len=2),
    }[qkv]
    q, k, v = _qkv_inputs() if layout == "rows" else _heads_inputs(torch.bfloat16)
    tensors = {"Q": q, "K": k, "V": v}
    rows = {t: x.reshape(-1, x.shape[-1]) for t, x in tensors.items()}
    e5m2 = dataclasses.replace(quantizer, fp8_dtype="e5m2")

    def quantized_do(state):  # as the emulated backward quantizes dO
        made, _ = quantize_tensor(rows["V"] * 1e-3, e5m2, (ROWWISE, COLUMNWISE), state)
        update_delayed_scaling(e5m2, state, made)
        return {"dO": made}

    cases = [
        (lambda state: flash_qkv(tensors, quantizer, state),
         lambda state: quantize_qkv(rows, quantizer, {"Q": (ROWWISE,), "K": (ROWWISE,), "V": (ROWWISE, COLUMNWISE)}, state)),
        (lambda state: joint_per_tensor({"dO": v * 1e-3}, e5m2, state, ("dO",)), quantized_do),
    ]
    for joint, reference in cases:
        states = [torch.tensor([0.5, 0.0, 7.0]) if quantizer.keeps_state else None for _ in range(2)]
        made, expected = joint(SlotState(states[0], None, 0)), reference(SlotState(states[1], None, 0))
        assert made.keys() == expected.keys()
        for t in made:
            assert made[t].keys() == expected[t].keys()
            for direction, op in made[t].items():
                ref = expected[t][direction]
                assert (op.spec, op.direction, op.shape) == (ref.spec, ref.direction, ref.shape)
                for a, e in zip(op.tensors, ref.tensors):
                    assert a.dtype == e.dtype and a.shape == e.shape, (t, direction)
                    assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, e.view(torch.uint8) if e.element_size() == 1 else e), (t, direction)
        if quantizer.keeps_state:
            assert torch.equal(states[0], states[1]) and states[0][-1] > 0  # the largest value recorded


def _heads_inputs(dtype, b=2, hq=4, hkv=2, lq=70, lk=130, d=64):
    """Q, K and V as attention takes a model's projections: (batch, heads, length, dim) views of
    (batch, length, heads, dim) tensors (transpose(1, 2)), fewer key/value heads than query heads,
    lengths that do not tile; a largest value in V."""
    q, k, v = (t.reshape(b, h, n, d).transpose(1, 2).contiguous().transpose(1, 2)
               for t, h, n in zip(_qkv_inputs(torch.float32, rows=(b * hq * lq, b * hkv * lk, b * hkv * lk)), (hq, hkv, hkv), (lq, lk, lk)))
    assert not q.is_contiguous() and q.stride(1) == d
    return tuple(t.to(dtype) for t in (q, k, v))


def check_joint_kernels(device: str) -> str:
    """graphquant.kernels.triton_joint_fp8's amax and cast on ``device`` against the ops'
    references on the CPU, bit for bit: bfloat16 and float32 inputs, row counts that do not tile
    and row counts that do (1024 rows, a float32 model's Q, K, V or dO at 2 x 2 heads of 256
    tokens), Q, K and V as (batch, heads, length, dim) views of (batch, length, heads, dim) under
    grouped-query attention, one tensor alone (dO) and four (two launches); E4M3 and E5M2, a scale
    that saturates (the layouts' cases at two of these), the cast's amax asked for and not, inf
    and NaN in the amax."""
    from graphquant.kernels import triton_joint_fp8

    checked = []
    cases = [(dtype, f"rows {rows[0]}", _qkv_inputs(dtype, rows=rows)) for dtype in (torch.bfloat16, torch.float32) for rows in ((130, 70, 70), (1024,) * 3)]
    cases += [(dtype, "heads", _heads_inputs(dtype)) for dtype in (torch.bfloat16, torch.float32)]
    q, k, v = _qkv_inputs(torch.bfloat16)
    cases += [(torch.bfloat16, "dO alone", (v[:, :32] * 1e-3,)), (torch.bfloat16, "four", (q, k, v, q[:3] * 2))]
    for dtype, what, tensors in cases:
        on_device = [x.to(device) for x in tensors]
        scales = (("e4m3", 448 / 40.0), ("e4m3", 100.0), ("e5m2", 57344 / 40.0), ("e5m2", 1e4))  # the amax's scale; one that saturates
        for fp8_dtype, scale in scales if what.startswith("rows") else scales[::3]:
            scale = torch.tensor(scale)
            for transposed, amax in (([False, False, True, False][: len(tensors)], True), ([True, False, False, True][: len(tensors)], False)):
                expected = torch.ops.graphquant.joint_cast(list(tensors), scale, fp8_dtype, transposed, amax)
                got = triton_joint_fp8.joint_cast(on_device, scale.to(device), fp8_dtype, transposed, amax)
                for name, a, e in zip(("codes", "transposed codes", "amax"), got, expected):
                    for a, e in zip(*((a, e) if name != "amax" else ([a], [e]))):
                        a = a.cpu()
                        assert a.dtype == e.dtype and a.shape == e.shape and a.is_contiguous(), name
                        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, e.view(torch.uint8) if e.element_size() == 1 else e), f"{dtype} {what} {fp8_dtype} scale {scale.item()}: {name}"
        checked.append(f"{dtype} {what} cast")
        for special in (float("inf"), float("nan")):
            last = tensors[-1].clone()
            last[..., 69 % last.shape[-2], 15] = special
            with_special = [*tensors[:-1], last]
            got = triton_joint_fp8.joint_amax([x.to(device) for x in with_special]).cpu()
            expected = torch.ops.graphquant.joint_amax(with_special)
            assert got.shape == () and (torch.equal(got, expected) or (got.isnan() and expected.isnan())), f"{dtype} {what} {special}: {got} != {expected}"
        checked.append(f"{dtype} {what} amax")
    return ", ".join(checked)


def test_joint_kernels_under_the_interpreter():
    """``check_joint_kernels`` with the kernels run by Triton's interpreter (the reference's
    float32 -> FP8 casts in place of the interpreter's)."""
    pytest.importorskip("triton")
    tests = os.path.dirname(__file__)
    script = INTERPRETER_SETUP + f"sys.path.insert(0, {tests!r})\nimport test_triton_attention\nprint(test_triton_attention.check_joint_kernels('cpu'))\n"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.gpu
def test_joint_kernels_on_the_gpu():
    print(check_joint_kernels("cuda"))


def test_configurations_refuse_what_the_kernels_cannot_run():
    pytest.importorskip("triton")
    from graphquant.kernels.triton_attention import ForwardConfig
    from graphquant.kernels.triton_attention_backward import BackwardConfig

    with pytest.raises(ValueError, match=r"ForwardConfig\(block_m=128, block_n=64, .*pv_promotion=128, .*\) is not a configuration: .*pv_promotion None or a multiple of 32 up to block_n"):
        ForwardConfig(block_n=64)
    assert ForwardConfig(block_n=64, pv_promotion=None).pv_promotion is None
    assert ForwardConfig(block_n=256).pv_promotion == 128
    with pytest.raises(ValueError, match=r"block_n=16, .* is not a configuration: block_m one of \(16, 32, 64, 128, 256\), block_n one of \(32, 64, 128, 256\)"):
        ForwardConfig(block_n=16, pv_promotion=None)  # PV shallower than one FP8 wgmma
    with pytest.raises(ValueError, match=r"pv_promotion=256, .*\) is not a configuration: .*a multiple of 32 up to block_n and 128"):
        ForwardConfig(block_n=256, pv_promotion=256)  # the tensor cores' narrow sum deeper than the tested bound
    with pytest.raises(ValueError, match=r"BackwardConfig\(.*num_warps=2.*\) is not a configuration: .*num_warps 4, 8 or 16"):
        BackwardConfig(num_warps=2)
    with pytest.raises(ValueError, match=r"BackwardConfig\(block_m=16.*\) is not a configuration: block_m and block_n one of \(32, 64, 128\)"):
        BackwardConfig(block_m=16)  # shallower than one FP8 wgmma
    with pytest.raises(ValueError, match=r"BackwardConfig\(block_m=64, block_n=256.*\) is not a configuration"):
        BackwardConfig(block_n=256)  # dQ's narrow sum deeper than the tested bound


# -- the kernel on the GPU ---------------------------------------------------------------------

def sums_apart(a, b, promote_every, roundings):
    """An elementwise bound on how far the kernels' and the emulation's a @ b (float64 values, or
    bounds on their magnitudes) may lie apart: the kernels sum on the FP8 tensor cores
    (``promote_every``: fp8.FAST for a product over the head dim, one product from zero, which
    they sum whole; fp8.PROMOTED_PRODUCTS over keys or queries, whose tiles, at most 128 deep,
    they add in fp32), the emulation in fp32 (fp8.accumulation_bound both), and either rounds
    ``roundings`` more times in fp32."""
    return fp8.accumulation_bound(a, b, promote_every) + fp8.accumulation_bound(a, b, fp8.FP32) + roundings * EPS32 * (a.abs() @ b.abs())


def flash_bound(q, k, v, o_flash, o_emulated, scale, causal, p_scale):
    """The largest |O_flash - O_emulated| the two quantizations of P allow, elementwise, the
    kernel's logsumexp bound per row, float64's logsumexp and softmax of the codes' scaled logits,
    and eta, each row's bound on the relative error of an unquantized P (so of its amax).

    With p the exact softmax of the codes' scaled logits, each side's P differs from p before its
    quantization by a factor within exp(+-2 delta) (delta: the error of a logit; the kernel sums
    Q.K on the tensor cores, the emulation in fp32; both exponentiate fp32 logits), and the sums l
    by lk fp32 roundings. Quantization then moves each value by at most half an E4M3 step
    (2^-4 relative) or half a subnormal step over the P scale both take (``p_scale``, the s
    format's for an amax of 1): the kernel quantizes exp(logit - running max) (p_scale entering
    through the exponent) and divides by l >= 1 after; the emulation quantizes the normalised p.
    So per key
        |P_flash - P_emulated| <= (2^-3 (1 + eta) + 2 eta (1 + eta)) p + 2^-9 / p_scale
    with eta = exp(2 delta) - 1 + 2 lk eps32, weighted by |V|. The PV sums add their accumulation
    error (``sums_apart``) over P's codes' bounds and |V|, and each side rounds O once to its dtype.
    """
    groups = q.shape[1] // k.shape[1]
    q64, k64, v64 = (t.double() for t in (q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)))
    lq, lk = q.shape[2], k.shape[2]
    x = q64 @ k64.transpose(-1, -2) * scale
    visible = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril() if causal else torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    x = x.masked_fill(~visible, -math.inf)
    exponent = 2.0**-20 * (1 + x.abs().masked_fill(~visible, 0).amax(-1, keepdim=True))  # scale, log2(e), exp2 in fp32
    # The kernel's exponents also carry log2(p_scale) (lg2.approx, within 2^-22, and the two fp32
    # roundings of the shifted max and of the FMA it enters, each within 2^-24 of log2(p_scale) more).
    exponent = exponent + (2.0**-22 + 2 * EPS32 * math.log2(p_scale)) * math.log(2)
    logits = scale * sums_apart(q64, k64.transpose(-1, -2), fp8.FAST, 3)
    delta = logits.masked_fill(~visible, 0).amax(-1, keepdim=True) + exponent
    eta = torch.expm1(2 * delta) + 2 * lk * EPS32
    p = torch.softmax(x, -1)
    per_key = (E4M3_ULP * (1 + eta) + 2 * eta * (1 + eta)) * p + E4M3_SUBNORMAL / p_scale
    quantized = (1 + E4M3_ULP / 2) * (1 + eta) * p + E4M3_SUBNORMAL / 2 / p_scale
    rounding = torch.finfo(o_flash.dtype).eps / 2  # unit roundoff of the output dtype
    # The kernel also rescales O once a key tile (of at least 32 keys).
    accumulation = sums_apart(quantized, v64.abs(), fp8.PROMOTED_PRODUCTS, math.ceil(lk / 32) + 4)
    o_bound = per_key @ v64.abs() + accumulation + rounding * (o_flash.double().abs() + o_emulated.double().abs()) * (1 + 2 * rounding)
    lse_bound = delta.squeeze(-1) + (lk + 4) * EPS32 * (1 + torch.logsumexp(x, -1).abs())
    return o_bound, lse_bound, torch.logsumexp(x, -1), p, eta


def check_against_the_emulation(b, heads, kv_heads, lq, lk, d, causal, device, config=None, dtype=torch.bfloat16) -> str:
    """The flash path's O within ``flash_bound`` of the emulation's, the kernel's O the flash
    path's and its logsumexp within its logit error of float64's; inputs (and O) in ``dtype``, current scaling. With ``config`` (a
    triton_attention.ForwardConfig promoting PV at least once a key tile) the kernel runs that
    configuration, whose O is held to the same bound. Says how much of each bound the errors
    took."""
    from graphquant.kernels import triton_attention

    q, k, v, _ = _inputs(b, heads, kv_heads, lq, lk, d, dtype, device)
    scale = 1 / math.sqrt(d)
    o_emulated = quantized_attention(q, k, v, is_causal=causal, site=AttentionSite(name="attn", call=0, **CURRENT))
    o_flash = quantized_attention(q, k, v, is_causal=causal, site=AttentionSite(name="attn", call=0, **CURRENT, backend=FLASH))
    assert o_flash.dtype == dtype and o_flash.shape == o_emulated.shape

    rows = lambda t: t.reshape(-1, d)  # noqa: E731
    made = quantize_qkv({"Q": rows(q), "K": rows(k), "V": rows(v)}, E4M3, {"Q": (ROWWISE,), "K": (ROWWISE,), "V": (ROWWISE, COLUMNWISE)}, SlotState(None, None, 0))
    codes = [made[t][ROWWISE].tensors[0].view(x.shape) for t, x in zip("QKV", (q, k, v))]
    scale_inv = made["Q"][ROWWISE].tensors[1]
    p_scale = E4M3.scale_of_amax(torch.ones(1, device=device))
    o_kernel, lse = triton_attention.forward(*codes[:2], made["V"][COLUMNWISE].tensors[0], scale_inv, p_scale, scale, causal, dtype, config=config)
    if config is None:
        assert torch.equal(o_kernel, o_flash)
        o_token_major, lse_token_major = triton_attention.forward(*codes[:2], made["V"][COLUMNWISE].tensors[0], scale_inv, p_scale, scale, causal, dtype, True)
        assert o_token_major.transpose(1, 2).is_contiguous(), f"O written token by token has strides {o_token_major.stride()}"
        assert torch.equal(o_token_major, o_kernel) and torch.equal(lse_token_major, lse), "O written token by token: other bits"
    elif config.qk_ahead:  # the same products and softmax, QK^T only issued earlier
        same_order = triton_attention.forward(*codes[:2], made["V"][COLUMNWISE].tensors[0], scale_inv, p_scale, scale, causal, dtype, config=dataclasses.replace(config, qk_ahead=False))
        assert all(map(torch.equal, (o_kernel, lse), same_order)), f"{config}: not the bits of the key loop without qk_ahead"
    o_flash = o_kernel

    values = [c.float() * scale_inv for c in codes]
    o_bound, lse_bound, lse64, p, eta = flash_bound(*values, o_flash, o_emulated, scale, causal, p_scale.item())
    error = (o_flash.double() - o_emulated.double()).abs()
    share = (error / o_bound).max().item()
    what = f"b{b} h{heads}/{kv_heads} {lq}x{lk} d{d} {'causal' if causal else 'full'} {dtype}{'' if config is None else f' {config}'}"
    assert share <= 1, f"{what}: O is {share:.3g} of the bound away from the emulation's (mean |error| {error.mean().item():.3g})"
    lse_share = ((lse.double() - lse64).abs() / lse_bound).max().item()
    assert lse_share <= 1, f"{what}: the logsumexp is {lse_share:.3g} of its bound away from float64's"
    return f"{what}: O error {share:.3g} of its bound (mean |error| {error.mean().item():.3g}), logsumexp {lse_share:.3g}"


GPU_SHAPES = [(4, 128, 64), (8, 1000, 128), (8, 2048, 128), (4, 1000, 64)]
# test_compiled_decoder_trains_with_the_flash_kernels's attention (2 heads of 64, 256 tokens, causal).
DECODER_SHAPE = (2, 2, 2, 256, 256, 64, True)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads, seq, d", GPU_SHAPES, ids=[f"h{h}-l{n}-d{d}" for h, n, d in GPU_SHAPES])
def test_kernel_against_the_emulation(heads, seq, d, causal):
    """``check_against_the_emulation`` at batch 2, 2 key/value heads."""
    print(check_against_the_emulation(2, heads, 2, seq, seq, d, causal, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernel_against_the_emulation_in_float32(causal):
    """``check_against_the_emulation`` on float32 inputs at the compiled decoder test's attention
    shape: Q, K and V of 1024 rows quantized from float32 (V^T by the joint cast), O in float32."""
    print(check_against_the_emulation(*DECODER_SHAPE[:6], causal, "cuda", dtype=torch.float32))


# -- the backward against the emulation ---------------------------------------------------------

def backward_bound(q, k, v, do, delta, o_dtype, eta, lse_bound, lse64, delta_logits, p, scale, causal, s_scale, dp_scale):
    """Elementwise bounds on |dQ, dK, dV of the flash backward - the emulation's|, and on the
    difference of the largest |dS| each records, from the dequantized codes (float64) both sides
    multiply, the D = rowsum(dO * O) both use, and the forward's bounds (``flash_bound``).

    P: each side's P differs from the exact softmax p by a factor within 1 +- eta_b, eta_b the
    larger of the emulation's eta and the kernel's expm1(logit error + logsumexp error + the
    rounding of its base-2 conversion). Both quantize P with the s slot's scale: the codes differ
    by at most the two P's difference plus two half steps of E4M3 (2^-3 relative together, or a
    subnormal step over the scale). dS = P (dP - D): the two sides' dP lie within gamma
    (``sums_apart`` over the head dim), so each side's dS is within
        eps_S = eta_b p |dP - D| + (1 + eta_b) p gamma + 3 eps32 (1 + eta_b) p (|dP - D| + gamma)
    of p (dP - D), and the E5M2 codes (dp's scale) within 2 eps_S + 2^-2 (|dS| + eps_S) + one
    subnormal step over the scale of each other. The products then weigh those differences by
    |K|, |Q| (times the softmax scale) and |dO|, add both sides' accumulation error over the
    product's length (``sums_apart``: one tile at a time in the tensor cores' accumulator, then
    fp32), and each side rounds once to the output dtype.
    """
    groups = q.shape[1] // k.shape[1]
    q64, do64 = q.double(), do.double()
    k64, v64 = (t.double().repeat_interleave(groups, 1) for t in (k, v))
    lk, d = k.shape[2], q.shape[3]
    eta_kernel = torch.expm1(delta_logits + lse_bound.unsqueeze(-1) + 2 * EPS32 * (1 + lse64.abs().unsqueeze(-1)))
    eta_b = torch.maximum(eta, eta_kernel)
    # A product over the keys or queries, a tile (at least 32 deep) at a time; dQ's tiles are scaled once each.
    tiles = lambda a, b: sums_apart(a, b, fp8.PROMOTED_PRODUCTS, math.ceil(a.shape[-1] / 32) + 6)  # noqa: E731
    rounding = torch.finfo(o_dtype).eps / 2

    dp_quantized = 2 * eta_b * p + E4M3_ULP * (1 + eta_b) * p + E4M3_SUBNORMAL / s_scale
    p_codes = (1 + E4M3_ULP / 2) * (1 + eta_b) * p + E4M3_SUBNORMAL / 2 / s_scale
    dv = dp_quantized.transpose(-1, -2) @ do64.abs() + tiles(p_codes.transpose(-1, -2), do64.abs())

    dp = do64 @ v64.transpose(-1, -2)
    gamma = sums_apart(do64, v64.transpose(-1, -2), fp8.FAST, 3)
    centred = (dp - delta.double().unsqueeze(-1)).abs()
    eps_s = eta_b * p * centred + (1 + eta_b) * p * gamma + 3 * EPS32 * (1 + eta_b) * p * (centred + gamma)
    ds = p * centred
    ds_quantized = 2 * eps_s + E5M2_ULP * (ds + eps_s) + E5M2_SUBNORMAL / dp_scale
    ds_codes = (1 + E5M2_ULP / 2) * (ds + eps_s) + E5M2_SUBNORMAL / 2 / dp_scale
    dq = scale * (ds_quantized @ k64.abs() + tiles(ds_codes, k64.abs()))
    dk = scale * (ds_quantized.transpose(-1, -2) @ q64.abs() + tiles(ds_codes.transpose(-1, -2), q64.abs()))
    dk, dv = (t.view(t.shape[0], -1, groups, lk, d).sum(2) for t in (dk, dv))
    return dq, dk, dv, rounding, 2 * eps_s.max().item()


def check_backward_against_the_emulation(b, heads, kv_heads, lq, lk, d, causal, device, warm=True, dtype=torch.bfloat16, backward=FLASH) -> str:
    """The flash backward's dQ, dK and dV within ``backward_bound`` of the emulation's (the zoo
    recipe's formats as planned: dp delayed, its state warmed by one emulated step, so that the
    scale is an earlier step's; not ``warm``: at its initial scale of 1, as a model's first
    step finds it, where most of dS's codes are subnormal), the dp state each leaves within the
    bound on dS, every other state and O equal; inputs in ``dtype``; ``backward`` the flash
    backward's backend (the Triton kernel's, or the Gluon one's). Says how much of each bound the
    errors took."""
    from graphquant.ops import attention
    from graphquant.ops.attention import flash_qkv, quantize_do, rowsum_do_o

    emulated = AttentionSite(name="attn", call=0, **ZOO, backend=FLASH)
    native = AttentionSite(name="attn", call=0, **ZOO, backend=FLASH, backward_backend=backward)
    states = [t if t is None else t.to(device) for t in _states(ZOO)]
    if warm:
        leaves = [t.to(dtype).requires_grad_() for t in _inputs(b, heads, kv_heads, lq, lk, d, device=device, seed=1)[:3]]
        o = quantized_attention(*leaves, is_causal=causal, site=emulated, states=states)
        torch.autograd.grad(o, leaves, _inputs(b, heads, kv_heads, lq, lk, d, device=device, seed=1)[3].to(dtype))
    before = [None if t is None else t.clone() for t in states]

    q, k, v, dout = _inputs(b, heads, kv_heads, lq, lk, d, dtype, device)
    results = {}
    for site in (emulated, native):
        site_states = [None if t is None else t.clone() for t in before]
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = quantized_attention(*leaves, is_causal=causal, site=site, states=site_states)
        results[site] = (o.detach(), *torch.autograd.grad(o, leaves, dout), site_states)
    (o_e, *grads_e, states_e), (o_n, *grads_n, states_n) = results[emulated], results[native]
    assert torch.equal(o_e, o_n)

    rows = lambda t: t.reshape(-1, d)  # noqa: E731
    made = flash_qkv({"Q": rows(q), "K": rows(k), "V": rows(v)}, E4M3, SlotState(None, None, 0))
    scale_inv = made["Q"][ROWWISE].tensors[1]
    values = [made[t][ROWWISE].tensors[0].float().view(x.shape) * scale_inv for t, x in zip("QKV", (q, k, v))]
    do_made = quantize_do(emulated, rows(dout), SlotState(None, None, 0))
    do_values = do_made[ROWWISE].tensors[0].float().view(q.shape) * do_made[ROWWISE].tensors[1]
    delta = rowsum_do_o(do_made, o_e.view(-1, lq, d)).view(b, heads, lq)
    scale = 1 / math.sqrt(d)
    dp_scale = before[3][0].item()
    p_scale = attention.p_scale(emulated, device).item()
    _, lse_bound, lse64, p, eta = flash_bound(*values, o_e, o_e, scale, causal, p_scale)
    groups = heads // kv_heads
    k64 = values[1].double().repeat_interleave(groups, 1)
    x = values[0].double() @ k64.transpose(-1, -2) * scale
    logits = scale * sums_apart(values[0].double(), k64.transpose(-1, -2), fp8.FAST, 3)
    delta_logits = logits.amax(-1, keepdim=True) + 2.0**-20 * (1 + x.abs().amax(-1, keepdim=True))
    *bounds, rounding, ds_bound = backward_bound(*values, do_values, delta, dtype, eta, lse_bound, lse64, delta_logits, p, scale, causal, p_scale, dp_scale)
    what = f"b{b} h{heads}/{kv_heads} {lq}x{lk} d{d} {'causal' if causal else 'full'} {dtype}{'' if warm else ' first step'}"
    shares = []
    for name, a, e, bound in zip(("dQ", "dK", "dV"), grads_n, grads_e, bounds):
        error = (a.double() - e.double()).abs()
        share = (error / (bound + rounding * (a.double().abs() + e.double().abs()) * (1 + 2 * rounding))).max().item()
        assert share <= 1, f"{what}: {name} is {share:.3g} of its bound away from the emulation's (mean |error| {error.mean().item():.3g})"
        shares.append(f"{name} {share:.3g}")
    for slot, a, e in zip(("qkv", "s", "do"), states_n, states_e):
        assert a is None or torch.equal(a, e), f"{what}: {slot}'s state"
    fp8_max = 57344.0
    amax_n, amax_e = fp8_max / states_n[3][0].item(), fp8_max / states_e[3][0].item()
    slack = 4 * EPS32 * amax_e  # the amax read back from the scale fp8_max / amax
    assert abs(amax_n - amax_e) <= ds_bound + slack, f"{what}: dS's amax {amax_n:.6g} against the emulation's {amax_e:.6g} (bound {ds_bound:.3g})"
    return f"{what}: " + ", ".join(shares) + " of their bounds"


BACKWARD_SHAPES = [(1, 2, 1, 70, 90, 64, True), (1, 2, 2, 90, 70, 64, False)]
BACKWARD_INTERPRETED = INTERPRETER_SETUP + textwrap.dedent(
    """
    sys.path.insert(0, %r)
    from graphquant.kernels import triton_attention, triton_attention_backward
    from graphquant.ops import registry
    import test_triton_attention

    registry.LIBRARY.impl("flash_attention", triton_attention.forward, "CPU")
    registry.LIBRARY.impl("flash_attention_backward", triton_attention_backward.backward, "CPU")
    for *shape, config, warm in %r:
        triton_attention_backward.DEFAULT_CONFIG = triton_attention_backward.BackwardConfig(**config)
        print(test_triton_attention.check_backward_against_the_emulation(*shape, device="cpu", warm=warm))
    """
)


@pytest.mark.parametrize("shape, warm, dtype", [(BACKWARD_SHAPES[0], True, torch.bfloat16), (BACKWARD_SHAPES[1], True, torch.bfloat16), (DECODER_SHAPE, False, torch.float32)],
                         ids=["gqa-causal", "full", "decoder-first-step"])
def test_backward_reference_against_the_emulation(emulated_kernel, shape, warm, dtype):
    """``check_backward_against_the_emulation`` with the backward op's reference on the CPU (the
    forward the emulation's own under current scaling, its logsumexp that of its logits)."""
    print(check_backward_against_the_emulation(*shape, device="cpu", warm=warm, dtype=dtype))
    assert emulated_kernel["backward calls"] == 1


def test_flash_backward_takes_d_from_the_codes_in_plain_ops(emulated_kernel):
    """The flash backward's D = rowsum(dO * O) reads dO's per-tensor codes in plain ops
    (graphquant::dequantize's values bit for bit), which Inductor fuses into the sum: no
    dequantize op, a separate kernel writing dO in fp32, runs in the backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.name())
            return func(*args, **(kwargs or {}))

    native = AttentionSite(name="attn", call=0, **ZOO, backend=FLASH, backward_backend=FLASH)
    q, k, v, dout = _inputs(1, 4, 2, 64, 64, 64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = quantized_attention(*leaves, is_causal=True, site=native, states=list(_states(ZOO)))
    with Calls() as calls:
        torch.autograd.grad(o, leaves, dout)
    assert "graphquant::flash_attention_backward" in calls.ops
    assert "graphquant::dequantize" not in calls.ops, calls.ops


WORK_ITEMS = textwrap.dedent(
    """
    import torch
    import triton
    import triton.language as tl

    from graphquant.kernels import triton_attention

    @triton.jit
    def items(out, blocks, section):
        rank, bh = triton_attention.work_item(tl.program_id(0), blocks, section)
        tl.store(out + 2 * tl.program_id(0), rank)
        tl.store(out + 2 * tl.program_id(0) + 1, bh.to(tl.int32))

    for blocks, heads, section in %r:
        out = torch.empty(blocks * heads, 2, dtype=torch.int32)
        items[(blocks * heads,)](out, blocks, section)
        print(out.tolist())
    """
)


def test_work_items_rank_by_block_in_sections_of_heads():
    """``work_item`` under Triton's interpreter: each (block rank, head) once; sections of one head
    take a head's blocks one after another; larger sections (one that divides the heads, one that
    leaves a shorter last section) take each rank of the section's heads before the next rank."""
    pytest.importorskip("triton")
    cases = [(5, 6, 1), (5, 6, 2), (5, 6, 4), (3, 2, 8)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", WORK_ITEMS % (cases,)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    for (blocks, heads, section), line in zip(cases, run.stdout.splitlines(), strict=True):
        items = [tuple(item) for item in eval(line)]
        sections = [range(first, min(first + section, heads)) for first in range(0, heads, section)]
        assert items == [(rank, head) for heads_here in sections for rank in range(blocks) for head in heads_here], (blocks, heads, section)


def test_backward_kernel_under_the_interpreter():
    """``check_backward_against_the_emulation`` with both kernels run by Triton's interpreter
    (the reference's float32 -> FP8 casts in place of the interpreter's): grouped heads (2 and 4
    query heads a key/value head's program walks), lengths
    that do not tile, causal and not, more queries than keys and fewer; the default tiles, and
    small ones (several key tiles adding into one dQ tile, query tiles shorter and longer than
    the key tiles, so the causal diagonal crosses them both ways, and each program starting its
    walk at another query tile); grouped heads over batches, several key tiles whose programs'
    dK and dV meet by atomic adds; and the compiled decoder test's attention at its first step
    (the delayed scales at 1, most of dS's codes subnormal)."""
    pytest.importorskip("triton")
    default = {}
    tall, wide = {"block_m": 64, "block_n": 32}, {"block_m": 32, "block_n": 64, "stagger": True}
    small = {"block_m": 32, "block_n": 32}
    shapes = [*((*shape, default) for shape in BACKWARD_SHAPES), (1, 2, 1, 130, 200, 128, True, default), (1, 2, 2, 150, 70, 64, True, default),
              (1, 2, 1, 70, 90, 64, True, tall), (1, 2, 1, 90, 70, 64, True, wide), (1, 2, 2, 90, 70, 64, False, wide),
              (1, 2, 2, 150, 150, 64, False, wide), (1, 4, 1, 90, 150, 64, True, wide),
              (2, 4, 2, 70, 90, 64, True, small), (1, 4, 1, 90, 70, 64, False, small)]
    shapes = [(*shape, True) for shape in shapes] + [(*DECODER_SHAPE, default, False)]
    tests = os.path.dirname(__file__)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", BACKWARD_INTERPRETED % (tests, shapes)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def backward_arguments(b, heads, kv_heads, lq, lk, d, causal, seed=0, device="cuda", forward=True):
    """A flash backward's arguments up to ``scales``: random codes of Q, K, V (E4M3) and dO (E5M2)
    with their transposes, the Triton forward's logsumexp of them (on the CPU under the
    interpreter; not ``forward``: zeros, for a call refused before it runs a kernel), D =
    rowsum(dO * O) and the scales (dS's large enough that some of its codes saturate)."""
    g = torch.Generator().manual_seed(seed)

    def codes(heads, n, dtype=torch.float8_e4m3fn):
        return (torch.randn(b, heads, n, d, generator=g) * 8).to(dtype).to(device)

    q, k, v, do = codes(heads, lq), codes(kv_heads, lk), codes(kv_heads, lk), codes(heads, lq, torch.float8_e5m2)
    transposed = lambda x: x.reshape(-1, d).t().contiguous()  # noqa: E731
    scales = torch.tensor([0.05, 0.01, 448.0, 1 / 448.0, 2.0**14, 2.0**-14], device=device)
    if forward:
        from graphquant.kernels import triton_attention

        o, lse = triton_attention.forward(q, k, transposed(v), scales[:1].clone(), scales[2:3].clone(), d**-0.5, causal, torch.float32)
    else:
        lse, o = torch.zeros(b, heads, lq, device=device), torch.zeros(q.shape, device=device)
    delta = (o * do.float()).sum(-1) * 0.01
    return q, transposed(q), k, transposed(k), v, do, transposed(do), lse, delta, scales


def assert_same_bits(names, got, expected, what=""):
    """Each of ``got`` has the dtype and the bits of its ``expected``."""
    for name, x, y in zip(names, got, expected):
        assert x.dtype == y.dtype, f"{what}{name}: {x.dtype}, not {y.dtype}"
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()]
        differ = x.view(bits) != y.view(bits)
        assert not differ.any(), f"{what}{name}: {differ.sum().item()} of {differ.numel()} differ, first at {differ.nonzero()[0].tolist()}"


# Cases every output of which has one value in any order of the atomic adds: at most two key tiles
# a dQ tile and two query heads a key/value head (two fp32 terms summed into zero). batch, heads,
# kv heads, Lq, Lk (multiples of 16, as the Gluon backward takes them), head dim, causal.
DTYPE_CASES = [(1, 4, 2, 208, 240, 128, True), (1, 2, 2, 112, 96, 64, False), (1, 2, 2, 80, 144, 128, True)]


def check_gradients_in_their_dtype(backward, device: str) -> str:
    """``backward`` (a flash backward's function, its default configuration) asked for dK and dV
    in bfloat16 and in float16 gives its float32 call's dK and dV each rounded once to that dtype
    (to nearest even, as .to(dtype) rounds), bit for bit, where the kernel stores them (no
    groups), and their float32 sums where it adds them (groups); dQ and dS's amax unchanged."""
    names = ("dQ", "dK", "dV", "dS amax")
    for b, heads, kv_heads, lq, lk, d, causal in DTYPE_CASES:
        args = (*backward_arguments(b, heads, kv_heads, lq, lk, d, causal, device=device), d**-0.5, causal, "e4m3", "e5m2")
        dq, dk, dv, ds_amax = backward(*args, torch.float32)
        for dtype in (torch.bfloat16, torch.float16):
            kv_dtype = dtype if heads == kv_heads else torch.float32
            expected = (dq, dk.to(kv_dtype), dv.to(kv_dtype), ds_amax)
            assert_same_bits(names, backward(*args, dtype), expected, f"h{heads}/{kv_heads} {lq}x{lk} d{d} {dtype}: ")
    return f"{len(DTYPE_CASES)} cases"


def check_nan_in_ds_amax(backward, device: str) -> str:
    """``backward`` (a flash backward's function) returns a NaN amax of dS where one code of dO is
    NaN (one row's dS all NaN), as torch.amax does, where the same call without it returns a
    finite, positive amax (so the NaN does not hide behind finite values)."""
    b, heads, kv_heads, lq, lk, d, causal = DTYPE_CASES[0]
    args = list(backward_arguments(b, heads, kv_heads, lq, lk, d, causal, device=device))
    rest = (d**-0.5, causal, "e4m3", "e5m2", torch.float32)
    finite = backward(*args, *rest)[3]
    do = args[5].clone()
    do.view(torch.uint8)[0, 1, 70, 3] = 0x7F  # an E5M2 NaN
    args[5], args[6] = do, do.reshape(-1, d).t().contiguous()
    got = backward(*args, *rest)[3]
    assert finite.isfinite() and finite > 0 and got.isnan(), (finite, got)
    return "NaN amax"


GRADIENT_DTYPES_INTERPRETED = INTERPRETER_SETUP + textwrap.dedent(
    """
    triton_interpreter.round_bfloat16_to_nearest()
    import test_triton_attention
    from graphquant.kernels import triton_attention_backward

    print(test_triton_attention.check_gradients_in_their_dtype(triton_attention_backward.backward, "cpu"))
    print(test_triton_attention.check_nan_in_ds_amax(triton_attention_backward.backward, "cpu"))
    """
)


def test_backward_gradients_in_their_dtype_under_the_interpreter():
    """``check_gradients_in_their_dtype`` and ``check_nan_in_ds_amax`` of the Triton backward run by
    Triton's interpreter (its float32 -> bfloat16 cast rounding to nearest even, as the GPU's)."""
    pytest.importorskip("triton")
    tests = os.path.dirname(__file__)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", GRADIENT_DTYPES_INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.gpu
def test_backward_gradients_in_their_dtype():
    from graphquant.kernels import triton_attention_backward

    print(check_gradients_in_their_dtype(triton_attention_backward.backward, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads, kv_heads, seq, d", [(8, 2, 1000, 128), (4, 4, 2048, 64)], ids=["gqa-l1000-d128", "l2048-d64"])
def test_backward_kernel_against_the_emulation(heads, kv_heads, seq, d, causal):
    """``check_backward_against_the_emulation`` at batch 2."""
    print(check_backward_against_the_emulation(2, heads, kv_heads, seq, seq, d, causal, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("shape, dtype", [(DECODER_SHAPE, torch.float32), ((2, 8, 2, 1000, 1000, 128, False), torch.bfloat16)],
                         ids=["decoder-float32", "gqa-l1000-d128-full"])
def test_backward_kernel_at_the_first_step(shape, dtype):
    """``check_backward_against_the_emulation`` with the s and dp scales at their initial 1, as
    a model's first training step finds them (most of P's and dS's codes subnormal): the compiled
    decoder test's attention (float32, so Q, K, V and dO of 1024 rows quantized from float32) and
    a grouped one."""
    print(check_backward_against_the_emulation(*shape, device="cuda", warm=False, dtype=dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", ["e4m3", "e5m2"])
def test_backward_casts_saturate(fp8_dtype):
    """The backward's P and dS casts (triton_scales.fp8_codes, no clamp of its own) are
    per_tensor.quantize bit for bit on the GPU: round to nearest even, values beyond the format's
    largest (inf included) saturate to it, NaN stays NaN."""
    import triton
    import triton.language as tl

    from graphquant.formats import per_tensor
    from graphquant.kernels import triton_attention_backward
    from graphquant.kernels.triton_scales import fp8_codes

    @triton.jit
    def cast(X, Y, scale, CODE: tl.constexpr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Y + offs, fp8_codes(tl.load(X + offs), scale, CODE))

    big, tie = (448.0, 464.0) if fp8_dtype == "e4m3" else (57344.0, 61440.0)  # the largest, and halfway past it
    scaled = [0.0, -0.0, 1.0, -1.0, big, -big, big * 1.03, tie, -tie, tie * 1.001, big * 1.2, -big * 1.2, 1e30, -1e30,
              math.inf, -math.inf, math.nan, 2.0**-9, 3 * 2.0**-10, 2.0**-16, 2.0**-17, 3 * 2.0**-18]
    scale = torch.tensor(2.0)  # the values above after the product: halving them is exact
    x = torch.cat([torch.tensor(scaled) / 2, torch.randn(2048 - len(scaled), generator=torch.Generator().manual_seed(0)) * big / 4])
    expected = per_tensor.quantize(x, scale, fp8_dtype, transpose=False)
    got = torch.empty(x.shape, dtype=expected.dtype, device="cuda")
    cast[(1,)](x.cuda(), got, scale.item(), triton_attention_backward.CODES[fp8_dtype], x.numel())
    got, nan = got.cpu(), x.isnan()
    wrong = got.view(torch.uint8)[~nan] != expected.view(torch.uint8)[~nan]
    assert not wrong.any(), f"{fp8_dtype}: {x[~nan][wrong].tolist()[:8]} cast to {got.float()[~nan][wrong].tolist()[:8]}, not {expected.float()[~nan][wrong].tolist()[:8]}"
    assert got.float()[nan].isnan().all()


# Backward configurations the tuning sweep may pick (triton_attention_backward.BackwardConfig's fields).
GPU_BACKWARD_CONFIGS = [
    {"block_m": 64, "block_n": 64, "num_stages": 2},
    {"block_m": 32, "block_n": 128, "num_stages": 2},
    {"block_m": 128, "block_n": 64, "num_stages": 2},
    {"block_m": 64, "block_n": 128, "num_stages": 4, "stagger": True},
]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("fields", GPU_BACKWARD_CONFIGS, ids=["-".join(f"{k}{v}" for k, v in c.items()) for c in GPU_BACKWARD_CONFIGS])
def test_backward_configurations_against_the_emulation(fields, causal, monkeypatch):
    """``check_backward_against_the_emulation`` in other configurations than the default, grouped
    heads, lengths that do not tile."""
    from graphquant.kernels import triton_attention_backward

    monkeypatch.setattr(triton_attention_backward, "DEFAULT_CONFIG", triton_attention_backward.BackwardConfig(**fields))
    print(check_backward_against_the_emulation(2, 8, 2, 1000, 1000, 128, causal, "cuda"))


# Configurations the tuning sweep (benchmarks/attention_tune.py) may pick: every tile shape and
# warp count at head dim 128, PV promoted once a key tile.
GPU_CONFIGS = [(64, 64, 4, 4), (64, 128, 4, 2), (128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 8, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("tiles", GPU_CONFIGS, ids=[f"m{m}-n{n}-w{w}-s{s}" for m, n, w, s in GPU_CONFIGS])
def test_kernel_configurations_against_the_emulation(tiles, causal):
    """``check_against_the_emulation`` in other configurations than the default, at lengths that
    do not tile."""
    from graphquant.kernels.triton_attention import ForwardConfig

    m, n, warps, stages = tiles
    config = ForwardConfig(block_m=m, block_n=n, num_warps=warps, num_stages=stages, pv_promotion=n)
    print(check_against_the_emulation(2, 8, 2, 1000, 1000, 128, causal, "cuda", config))


VARIANTS = {"ahead": {"qk_ahead": True}, "order": {"operand_order": True}, "order-ahead": {"operand_order": True, "qk_ahead": True}}


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads, seq, d", GPU_SHAPES[1:], ids=[f"h{h}-l{n}-d{d}" for h, n, d in GPU_SHAPES[1:]])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kernel_variants_against_the_emulation(variant, heads, seq, d, causal):
    """``check_against_the_emulation`` of the default tiles with QK^T a tile ahead (the bits of the
    plain key loop), S's keys in the PV operand's order, and both."""
    from graphquant.kernels.triton_attention import ForwardConfig

    print(check_against_the_emulation(2, heads, 2, seq, seq, d, causal, "cuda", config=ForwardConfig(**VARIANTS[variant])))


def flash_kernels_launched_again(device: str) -> int:
    """How many of six calls of the two kernels (forward and backward, three times: tensors A,
    other tensors, A again) went through Triton's own launch, the third call's outputs checked to be
    the first's bit for bit. Grouped heads, lengths that do not tile, one key tile: no atomic add
    into dQ meets another, and each key/value head's dK and dV add two query heads' into zero (one
    fp32 sum whatever the order), so every output has the same bits in every run."""
    from graphquant.kernels import triton_attention, triton_attention_backward

    runs = []
    with pytest.MonkeyPatch.context() as patch:
        for kernel in (triton_attention._forward_kernel, triton_attention_backward._backward_kernel):
            patch.setattr(kernel, "run", lambda *args, run=kernel.run, **kwargs: runs.append(1) or run(*args, **kwargs))
        g = torch.Generator().manual_seed(0)
        b, h, kv_heads, lq, lk, d = 2, 4, 2, 300, 100, 128
        scales = torch.tensor([0.05, 0.01, 448.0, 1 / 448.0, 2.0**14, 2.0**-14], device=device)
        scale_inv, p_scale = (scales[i].clone().reshape(1) for i in (0, 2))
        transposed = lambda x: x.reshape(-1, d).t().contiguous()  # noqa: E731

        def codes(shape, dtype=torch.float8_e4m3fn):
            return (torch.randn(shape, generator=g) * 8).to(dtype).to(device)

        def run(q, k, v, do):
            o, lse = triton_attention.forward(q, k, transposed(v), scale_inv, p_scale, d**-0.5, True, torch.bfloat16)
            delta = (o.float() * do.float()).sum(-1) * 0.01
            grads = triton_attention_backward.backward(
                q, transposed(q), k, transposed(k), v, do, transposed(do), lse, delta, scales, d**-0.5, True, "e4m3", "e5m2", torch.bfloat16
            )
            return o, lse, *grads

        first, other = ([codes((b, h, lq, d)), codes((b, kv_heads, lk, d)), codes((b, kv_heads, lk, d)), codes((b, h, lq, d), torch.float8_e5m2)]
                        for _ in range(2))
        expected = run(*first)
        run(*other)
        for name, x, y in zip(("O", "lse", "dQ", "dK", "dV", "dS amax"), expected, run(*first)):
            assert torch.equal(x, y), f"{name} differs from the first call's"
    return len(runs)


@pytest.mark.gpu
def test_the_flash_kernels_go_through_triton_once_per_call_signature():
    """Both kernels launch through triton_launch.launch: Triton binds their arguments at a call
    signature's first call alone, and later calls, on other tensors, write Triton's bits."""
    assert flash_kernels_launched_again("cuda") == 2


@pytest.mark.gpu
def test_compiled_decoder_trains_with_the_flash_kernels(tmp_path):
    """On an H200 the zoo recipe's causal attention plans the Gluon flash forward and backward, the compiled graph (aot_eager: the autograd formula traced, the kernels' ops
    through their fakes) runs them, and two training steps keep every gradient finite."""
    model = _decoder().cuda()
    x = torch.randn(2, 256, 256, device="cuda")
    recipe = zoo.recipe("nvfp4_linear_fp8_dpa")
    plan = graphquant.explain(model, recipe, x)
    assert {g.gemm: g.backend for g in plan.gemms if g.module_type == "dpa"} == {gemm: GLUON for gemm in ("qk", "pv", "dv", "dp", "dq", "dk")}
    compiled = graphquant.compile(model, recipe, backend="aot_eager", dump_dir=str(tmp_path))
    for _ in range(2):
        compiled(x).square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert f"backend={GLUON!r}, backward_backend={GLUON!r}" in (tmp_path / "graph_000_rewritten.py").read_text()
