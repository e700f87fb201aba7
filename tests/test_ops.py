"""Every graphquant custom op passes torch.library.opcheck (schema, fake, autograd registration)."""

from unittest import mock

import pytest
import torch

import graphquant  # noqa: F401  (registers the ops)
from torch.utils._python_dispatch import TorchDispatchMode

from graphquant import distributed
from graphquant.kernels import backends, emulation, native, scaled_mm
from graphquant.kernels.backends import GemmBackend
from graphquant.formats import nvfp4
from graphquant.ops.functional import quantized_linear, quantized_matmul
from graphquant.ops.quantize import SlotState, _quantize_direction, quantize_weight
from graphquant.ops.site import Site
from graphquant.quantizers import (
    COLUMNWISE,
    ROWWISE,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8DelayedScalingQuantizer,
    HybridQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizeContext,
)

SPECS = [
    Float8CurrentScalingQuantizer("e5m2"),
    Float8BlockQuantizer(block_scaling_dim=1),
    MXFP8Quantizer(),
    NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, stochastic_rounding=True),
    NVFP4Quantizer(with_2d_quantization=True, row_scaled_nvfp4=True),
]
# The backends of a site whose three GEMMs are emulated (as a plan on this CPU gives every site).
EMULATED = {gemm: GemmBackend(backends.EMULATION) for gemm in ("fprop", "dgrad", "wgrad")}


@pytest.mark.parametrize("rowwise,columnwise,dbias", [(True, False, False), (False, True, False), (True, True, True)])
@pytest.mark.parametrize("quantizer", SPECS + [HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(), "rowwise_dequantized")], ids=str)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_quantize_op(quantizer, rowwise, columnwise, dbias, device):
    """On CUDA the kernels make the representations (NVFP4's two directions share one global amax)."""
    x = torch.randn(64, 96, dtype=torch.bfloat16, device=device)
    rng = torch.tensor([7, 3], device=device)
    args = (x, quantizer.spec, rowwise, columnwise, None, rng, 1, dbias)
    torch.library.opcheck(torch.ops.graphquant.quantize.default, args)
    out = torch.ops.graphquant.quantize(*args)
    assert len(out) == 3 * (rowwise + columnwise) + dbias
    if dbias:
        assert torch.equal(out[-1], x.float().sum(0).to(x.dtype))


def test_a_fake_quantize_works_a_layout_out_once_a_shape(monkeypatch):
    """Tracing runs a quantize op's fake at every call; the reference behind it (hundreds of fake
    tensor ops, most of graphquant's part of a first call) runs once a spec, direction and shape, so
    eight layers of one shape trace it as often as one does; a symbolic shape works it out each time."""
    from torch._subclasses.fake_tensor import FakeTensor

    from graphquant.ops import library

    calls, reference = [], native.reference_quantize

    def counting(quantizer, x, direction, ctx):
        calls.append(isinstance(x, FakeTensor))
        return reference(quantizer, x, direction, ctx)

    monkeypatch.setattr(native, "reference_quantize", counting)

    def traced(layers: int, dynamic: bool = False) -> int:
        calls.clear()
        library._LAYOUTS.clear()
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(layers)])
        compiled = graphquant.compile(model, graphquant.recipes.mxfp8_block_scaling(), backend="aot_eager", dynamic=dynamic)
        compiled(torch.randn(32, 64)).sum().backward()
        torch._dynamo.reset()
        return sum(calls)

    one, eight = traced(1), traced(8)
    assert 0 < one == eight
    assert traced(8, dynamic=True) > eight


class _NoKernels:
    """An extension that takes CPU tensors and must not be asked to quantize."""

    emulated = True

    def quantize(self, *args):
        raise AssertionError("a kernel quantized a tensor whose amax must be all-reduced first")


@pytest.mark.parametrize(
    "quantizer",
    [
        NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, with_amax_reduction=True),
        HybridQuantizer(Float8CurrentScalingQuantizer(with_amax_reduction=True), MXFP8Quantizer()),
    ],
    ids=str,
)
def test_quantize_op_all_reduces_the_amax_of_formats_that_ask(quantizer, monkeypatch):
    """Given a process group, graphquant::quantize all-reduces each reducing direction's amax and
    encodes with the result, never through a kernel (they encode with the amax they take of x in
    the same pass); the all-reduce is faked as another rank having seen 4x larger values."""
    groups = []

    def all_reduce_amax(amax, group):
        groups.append(group)
        return amax * 4

    monkeypatch.setattr(distributed, "all_reduce_amax", all_reduce_amax)
    monkeypatch.setattr(native, "extension", lambda: _NoKernels())
    x = torch.randn(64, 96)
    out = torch.ops.graphquant.quantize(x, quantizer.spec, True, True, None, None, 0, False, "world")
    assert groups and set(groups) == {"world"}
    expected = quantizer(x, ctx=QuantizeContext(amax_group="world"))
    for made, rep in zip((out[:3], out[3:]), (expected.rowwise, expected.columnwise)):
        assert all(torch.equal(_bits(m), _bits(e)) for m, e in zip(made, rep.tensors())), rep.direction
    rowwise_amax = x.abs().amax()
    assert torch.equal(out[2], 4 * rowwise_amax)  # the rowwise direction encoded with the reduced amax
    if isinstance(quantizer, NVFP4Quantizer):
        after_rht = nvfp4.hadamard_transform(x.t(), random_sign_mask=True).abs().amax()
        assert torch.equal(out[5], 4 * after_rht)


def test_quantize_op_with_delayed_scale():
    x = torch.randn(32, 48)
    quantizer = Float8DelayedScalingQuantizer("e4m3", amax_history_len=4)
    args = (x, quantizer.spec, False, True, torch.tensor([2.0]), None, 0)
    torch.library.opcheck(torch.ops.graphquant.quantize.default, args)


# opcheck's test_schema compares inputs before and after the call with torch.allclose, which
# torch does not implement for float8 tensors; for ops that take FP8 data the same property (no
# input is mutated) is checked here bit for bit instead.
WITHOUT_SCHEMA = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def _bits(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _check_no_mutation(op, args):
    tensors = [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]
    before = [t.clone() for t in tensors]
    op(*args)
    assert all(torch.equal(_bits(old), _bits(new)) for old, new in zip(before, tensors))


@pytest.mark.parametrize("quantizer", SPECS, ids=str)
def test_dequantize_and_gemm_ops(quantizer):
    torch.manual_seed(0)
    state = SlotState(None, torch.tensor([1, 2]), 0)
    x = _quantize_direction(torch.randn(64, 96), quantizer, ROWWISE, state)
    w = _quantize_direction(torch.randn(32, 96), quantizer, ROWWISE, state)
    dequantize_args = (x.tensors, x.spec, ROWWISE, list(x.shape), torch.float32)
    gemm_args = (x.tensors, x.spec, ROWWISE, list(x.shape), w.tensors, w.spec, ROWWISE, list(w.shape), 1, torch.float32)
    gemm_args += (backends.EMULATION, False, "fc#0 fprop")
    for op, args in ((torch.ops.graphquant.dequantize.default, dequantize_args), (torch.ops.graphquant.gemm.default, gemm_args)):
        torch.library.opcheck(op, args, test_utils=WITHOUT_SCHEMA)
        _check_no_mutation(op, args)


def test_scale_ops():
    amax = torch.tensor([0.0, 1.0, 448.0, float("inf"), float("nan"), 3e-40])
    torch.library.opcheck(torch.ops.graphquant.fp8_scales.default, (amax, "e4m3", 0.0, True))
    # opcheck compares outputs without equal_nan, and a NaN amax's multiplier is NaN (test_formats_mxfp8)
    torch.library.opcheck(torch.ops.graphquant.e8m0_scales.default, (amax[~amax.isnan()], "e5m2"))


def test_frozen_weight_stand_in_op():
    """A frozen linear's weight in compiled code: its shape and dtype on the codes' device, one element's memory."""
    codes = torch.zeros(32, 96, dtype=torch.uint8)
    args = (codes, [32, 96], torch.bfloat16, "fc")
    torch.library.opcheck(torch.ops.graphquant.frozen_weight_stand_in.default, args)
    stand_in = torch.ops.graphquant.frozen_weight_stand_in(*args)
    assert (stand_in.shape, stand_in.dtype, stand_in.device, stand_in.untyped_storage().nbytes()) == ((32, 96), torch.bfloat16, codes.device, 2)


def test_an_op_on_tensors_that_require_grad_records_nothing_and_its_backward_warns():
    """The ops are not differentiable (quantized_gemm composes them): called directly in grad mode, the
    reference's torch ops inside must not build a graph, and a backward through one warns."""
    x = torch.randn(64, 96, dtype=torch.bfloat16, requires_grad=True)
    data, scale, amax = torch.ops.graphquant.quantize(x, Float8BlockQuantizer(block_scaling_dim=1).spec, True, False, None, None, 0)
    assert scale.grad_fn is None or "CppFunction" in type(scale.grad_fn).__name__  # the fallback's node, not the reference's
    transposed = torch.ops.graphquant.transposed(x)
    with pytest.warns(UserWarning, match="autograd kernel was not registered"):
        (transposed.float().sum() + x.float().sum()).backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # x's own term only


class _OpCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


def test_linear_bias_is_added_in_the_gemm_and_its_gradient_made_by_the_grad_output_quantize():
    torch.manual_seed(0)
    x, w, bias = torch.randn(64, 96, requires_grad=True), torch.randn(32, 96, requires_grad=True), torch.randn(32, requires_grad=True)
    site = Site(name="fc", call=0, input=MXFP8Quantizer().spec, weight=MXFP8Quantizer().spec, grad_output=NVFP4Quantizer().spec, streams=(0, 1, 2), **EMULATED)
    rng = torch.tensor([1, 2])
    dy = torch.randn(64, 32)
    with _OpCalls() as mode:
        y = quantized_linear(x, w, bias, site=site, rng=rng)
        y.backward(dy)
    assert torch.equal(y, quantized_linear(x, w, None, site=site, rng=rng) + bias)  # fp32: the sum rounds once either way
    assert torch.equal(bias.grad, dy.sum(0))
    gemms = [args for func, args in mode.calls if func is torch.ops.graphquant.gemm.default]
    bias_index = [a.name for a in torch.ops.graphquant.gemm.default._schema.arguments].index("bias")
    assert gemms[0][bias_index] is bias, "the forward GEMM takes the bias"
    quantizes = [args for func, args in mode.calls if func is torch.ops.graphquant.quantize.default]
    # NVFP4 is made by a kernel: grad_output's two directions and the bias gradient in one call.
    assert [(q[2], q[3], q[-1]) for q in quantizes if q[0].shape == dy.shape] == [(True, True, True)]


@pytest.mark.parametrize(
    "quantizer, one_call",
    [
        (Float8BlockQuantizer(block_scaling_dim=1), True),  # 1x128 and 128x1
        (MXFP8Quantizer(), True),  # 1x32 and 32x1
        (HybridQuantizer(MXFP8Quantizer(), Float8BlockQuantizer(block_scaling_dim=1)), True),
        (Float8BlockQuantizer(block_scaling_dim=2), False),  # one 128x128 amax serves both
        (Float8CurrentScalingQuantizer(), False),  # one per-tensor amax
    ],
)
def test_activations_and_gradients_scaled_over_two_blockings_are_made_in_one_call(quantizer, one_call):
    """Traced, each blocking is an Inductor reduction of its own that recomputes the operand's
    producer; the kernel makes both directions from one read. The weight stays traced, so that
    backward recomputes its copies from the parameter rather than keep them."""
    torch.manual_seed(0)
    x, w = torch.randn(128, 128, requires_grad=True), torch.randn(64, 128, requires_grad=True)
    spec = quantizer.spec
    site = Site(name="fc", call=0, input=spec, weight=spec, grad_output=spec, streams=(0, 1, 2), **EMULATED)
    with _OpCalls() as mode:
        quantized_linear(x, w, None, site=site, rng=torch.tensor([1, 2])).backward(torch.randn(128, 64))
    quantizes = [args for func, args in mode.calls if func is torch.ops.graphquant.quantize.default]
    made = [((128, 128), True, True), ((128, 64), True, True)]  # x, grad_output
    weight = [((64, 128), True, False)] if isinstance(quantizer, Float8CurrentScalingQuantizer) else []  # quantize_weight
    assert [(tuple(q[0].shape), q[2], q[3]) for q in quantizes] == (made if one_call else []) + weight


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(
    "quantizer, block_local",
    [
        (Float8CurrentScalingQuantizer(), False),
        (Float8CurrentScalingQuantizer("e5m2", True, 1e-3), False),
        (Float8BlockQuantizer(block_scaling_dim=2, force_pow_2_scales=False), True),
        (Float8BlockQuantizer(block_scaling_dim=1), True),
        (MXFP8Quantizer(), True),
    ],
)
def test_a_weights_rowwise_copy_comes_from_one_call(quantizer, block_local, device):
    """A parameter's traced amax and cast fuse with nothing, so a weight's rowwise copy comes from
    one graphquant::quantize call with its per-tensor amax, or where w's device has the kernel
    that makes it in one read (block-local scales: not the CPU, where the op would run the
    reference eagerly); its columnwise copy is traced (per-tensor scaling's from that amax), so
    that the backward recomputes it from the parameter. Both equal the quantizer's own
    representations, bit for bit."""
    torch.manual_seed(0)
    w = (torch.randn(64, 128) * torch.exp2(torch.randint(-8, 9, (64, 1)).float())).to(device)
    state = SlotState(None, None, 1)
    with _OpCalls() as mode:
        operands = quantize_weight(w, quantizer, (ROWWISE, COLUMNWISE), state)
    quantizes = [args for func, args in mode.calls if func is torch.ops.graphquant.quantize.default]
    one_call = not block_local or native.extension_for(w.device) is not None
    assert [(q[2], q[3]) for q in quantizes] == ([(True, False)] if one_call else [])
    ctx = QuantizeContext()
    for direction, reference in ((ROWWISE, quantizer.quantize_rowwise(w, ctx)), (COLUMNWISE, quantizer.quantize_columnwise(w, ctx))):
        for made, expected in zip(operands[direction].tensors, reference.tensors()):
            assert made.dtype == expected.dtype and made.shape == expected.shape, direction
            assert torch.equal(made.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), direction  # bits


@pytest.mark.gpu
@pytest.mark.parametrize(
    "quantizer, in_backward",
    [
        (MXFP8Quantizer(), True),  # 1x32 and 32x1
        (Float8BlockQuantizer(block_scaling_dim=1), True),  # 1x128 and 128x1
        (Float8BlockQuantizer(block_scaling_dim=2, force_pow_2_scales=False), False),  # one 128x128 tile's scale for both
    ],
)
def test_a_weights_columnwise_copy_over_other_blocks_is_made_in_backward_from_the_parameter(quantizer, in_backward):
    """Where the kernel makes a weight's rowwise copy and the columnwise one scales other blocks,
    the backward makes that from the parameter it saved (traced, it was an amax and a cast of its
    own); 128x128 tiles' stays traced. dx and dw are the all-traced path's, bit for bit."""
    torch.manual_seed(0)
    x, w = torch.randn(256, 128, device="cuda", requires_grad=True), torch.randn(128, 128, device="cuda", requires_grad=True)
    dy = torch.randn(256, 128, device="cuda")  # w alone is 128x128
    site = Site(name="fc", call=0, input=quantizer.spec, weight=quantizer.spec, grad_output=quantizer.spec, streams=(0, 1, 2), **EMULATED)
    with _OpCalls() as forward:
        y = quantized_linear(x, w, None, site=site)
    with _OpCalls() as backward:
        y.backward(dy)

    def weight_calls(mode):
        return [(q[2], q[3]) for func, q in mode.calls if func is torch.ops.graphquant.quantize.default and tuple(q[0].shape) == (128, 128)]

    assert (weight_calls(forward), weight_calls(backward)) == ([(True, False)], [(False, True)] if in_backward else [])
    xt, wt = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with mock.patch("graphquant.ops.quantize.made_in_one_read", return_value=False), mock.patch(
        "graphquant.ops.quantized_gemm.columnwise_in_backward", return_value=False
    ):
        quantized_linear(xt, wt, None, site=site).backward(dy)
    assert torch.equal(x.grad, xt.grad) and torch.equal(w.grad, wt.grad)


def test_backward_runs_wgrad_before_dgrad():
    """wgrad first, so that its input operand (a down projection's h, or h's FP8 copy) is freed
    before dgrad's output, often as large, is allocated."""
    torch.manual_seed(0)
    x, w = torch.randn(128, 96, requires_grad=True), torch.randn(64, 96, requires_grad=True)
    spec = Float8CurrentScalingQuantizer().spec
    y = quantized_linear(x, w, None, site=Site(name="fc", call=0, input=spec, weight=spec, grad_output=spec, streams=(0, 1, 2), **EMULATED))
    with _OpCalls() as mode:
        y.backward(torch.randn(128, 64))
    products = [tuple(args[3]) + tuple(args[7]) for func, args in mode.calls if func is torch.ops.graphquant.gemm.default]
    # (a's logical shape, b's): wgrad reads grad_output (128, 64) and x (128, 96); dgrad grad_output and w (64, 96)
    assert products == [(128, 64, 128, 96), (128, 64, 64, 96)]


def test_each_gemm_gets_its_own_backend_from_the_site(monkeypatch):
    """fprop, wgrad and dgrad (the backward runs wgrad first) each pass their own backend to the
    GEMM op, and it runs that one (on a faked Hopper, the emulated GEMM standing in for cuBLASLt)."""
    monkeypatch.setattr(backends, "capability", lambda device: (9, 0))
    backends.clear_caches()
    ran = []

    def stand_in(backend, a, b, out_dtype, bias=None):
        ran.append(backend)
        return emulation.gemm(a, b, 1, out_dtype, bias)[0]

    monkeypatch.setattr(scaled_mm, "run", stand_in)
    x, w = torch.randn(64, 96, requires_grad=True), torch.randn(32, 96, requires_grad=True)
    spec = Float8CurrentScalingQuantizer().spec
    fprop, dgrad = GemmBackend(scaled_mm.TENSORWISE, fast_accumulation=True), GemmBackend(scaled_mm.TENSORWISE)
    site = Site(name="fc", call=0, input=spec, weight=spec, grad_output=spec, streams=(0, 1, 2), fprop=fprop, dgrad=dgrad, wgrad=EMULATED["wgrad"])
    try:
        with _OpCalls() as mode:
            quantized_linear(x, w, None, site=site).sum().backward()
    finally:
        backends.clear_caches()
    names = [a.name for a in torch.ops.graphquant.gemm.default._schema.arguments]
    fields = [names.index("backend"), names.index("fast_accumulation"), names.index("site")]
    calls = [tuple(args[i] for i in fields) for func, args in mode.calls if func is torch.ops.graphquant.gemm.default]
    assert calls == [(scaled_mm.TENSORWISE, True, "fc#0 fprop"), (backends.EMULATION, False, "fc#0 wgrad"), (scaled_mm.TENSORWISE, False, "fc#0 dgrad")]
    assert ran == [fprop, dgrad]


def test_only_a_contiguous_weight_takes_the_one_call():
    """quantize_weight's one call is for a linear's (n, k) weight: an activation as a product's
    other operand (attention's k) keeps its traced amax, fused into its producer, and a weight
    used as x @ w (a transposed view) stays traced rather than be copied first."""
    torch.manual_seed(0)
    spec = Float8CurrentScalingQuantizer().spec
    a, b = torch.randn(2, 16, 64, requires_grad=True), torch.randn(2, 64, 32, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(64, 32))
    formats = dict(name="mm", call=0, input=spec, grad_output=spec, streams=(0, 1, 2), **EMULATED)
    for kwargs in (dict(other=spec), dict(weight=spec)):
        with _OpCalls() as mode:
            rhs = b if "other" in kwargs else w
            quantized_matmul(a, rhs, site=Site(**formats, **kwargs), rng=torch.tensor([1, 2])).sum().backward()
        assert not [args for func, args in mode.calls if func is torch.ops.graphquant.quantize.default], kwargs
