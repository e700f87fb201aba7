"""Pass 4: the clamp in front of a saturating float32 -> FP8 cast is dropped, and nothing else."""

import copy

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

import graphquant
from graphquant.formats import fp8, mxfp8, per_tensor
from graphquant import zoo
from graphquant.passes import saturating_cast
from graphquant.passes.saturating_cast import SaturatingCast, cuda_saturates, drop_saturated_clamps

aten, prims = torch.ops.aten, torch.ops.prims
CLAMPS = (aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default)
FP8 = ("e4m3", "e5m2")


def always(device):
    return True


class _Captured(Exception):
    """Stops Inductor once the post-grad graph is in hand: these tests never need its C++ code."""


def post_grad_graph(fn, *args):
    """The graph Inductor lowers for fn(*args), before any custom pass."""
    graphs = []

    def capture(graph):
        graphs.append(graph)
        raise _Captured

    with inductor_config.patch(post_grad_custom_post_pass=capture, fx_graph_cache=False):
        torch._dynamo.reset()
        with pytest.raises(Exception):  # _Captured, as this torch's Inductor and Dynamo wrap it
            torch.compile(fn, dynamic=False)(*args)
    (graph,) = graphs
    return graph


def targets(graph):
    return [n.target for n in graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_a_per_tensor_cast_reads_its_product_unclamped(fp8_dtype):
    x, scale = torch.randn(64, 96, dtype=torch.bfloat16), torch.tensor(3.0)
    graph = post_grad_graph(lambda x, s: per_tensor.quantize(x, s, fp8_dtype, transpose=False), x, scale)
    assert any(t in CLAMPS for t in targets(graph))
    assert drop_saturated_clamps(graph, always) == 1
    assert not any(t in CLAMPS for t in targets(graph))
    (cast,) = [n for n in graph.nodes if n.target == prims.convert_element_type.default and n.args[1].itemsize == 1]
    assert cast.args[0].target == aten.mul.Tensor


def test_mxfp8_traced_cast_too():
    """As a quantize traced into a graph runs it: its scales from the op graphquant::e8m0_scales."""
    x = torch.randn(64, 96, dtype=torch.bfloat16)
    graph = post_grad_graph(lambda x: mxfp8.quantize(x, "e4m3", axis=1, scales=torch.ops.graphquant.e8m0_scales), x)
    assert drop_saturated_clamps(graph, always) == 1
    assert not any(t in CLAMPS for t in targets(graph))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.clamp(x.float(), -400.0, 400.0).to(torch.float8_e4m3fn),  # not the format's limit
        lambda x: torch.clamp(x.float(), -448.0, 448.0).to(torch.float8_e5m2),  # e4m3's limit, e5m2's cast
        lambda x: torch.clamp(x, -448.0, 448.0).to(torch.float8_e4m3fn),  # a bfloat16 source: another cvt
        lambda x: torch.clamp(x.float(), min=-448.0).to(torch.float8_e4m3fn),  # one side only
        lambda x: x.float().neg().to(torch.float8_e4m3fn),  # no clamp at all
    ],
    ids=["other limit", "other format", "bfloat16 source", "one side", "no clamp"],
)
def test_other_clamps_stay(fn):
    graph = post_grad_graph(fn, torch.randn(8, 8, dtype=torch.bfloat16))
    before = targets(graph)
    assert drop_saturated_clamps(graph, always) == 0
    assert targets(graph) == before


def test_a_clamp_with_other_users_stays_for_them():
    def fn(x):
        clamped = torch.clamp(x, -448.0, 448.0)
        return clamped.to(torch.float8_e4m3fn), clamped * 2

    graph = post_grad_graph(fn, torch.randn(8, 8))
    assert drop_saturated_clamps(graph, always) == 1
    outer = [n for n in graph.nodes if n.target in CLAMPS][-1]
    assert [u.target for u in outer.users] == [aten.mul.Tensor]
    (cast,) = [n for n in graph.nodes if n.target == prims.convert_element_type.default]
    assert cast.args[0].op == "placeholder"


def test_cpu_graphs_keep_their_clamps():
    graph = post_grad_graph(lambda x: torch.clamp(x, -448.0, 448.0).to(torch.float8_e4m3fn), torch.randn(8, 8))
    assert not cuda_saturates(torch.device("cpu"))
    assert drop_saturated_clamps(graph) == 0
    assert drop_saturated_clamps(graph, always) == 1


def test_a_users_post_grad_pass_still_runs():
    class Counting(CustomGraphPass):
        calls = 0

        def __call__(self, graph):
            Counting.calls += 1

        def uuid(self):
            return "counting"

    chained = SaturatingCast(then=Counting())
    x = torch.randn(8, 8)
    with inductor_config.patch(post_grad_custom_post_pass=chained, fx_graph_cache=False):
        torch._dynamo.reset()
        torch.compile(lambda x: x.sin() + 1)(x)
    assert Counting.calls == 1
    assert chained.uuid()[1] == "counting"
    assert SaturatingCast(then=lambda graph: None).uuid() is None  # no uuid: Inductor bypasses its cache


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_cuda_cast_without_the_clamp_is_bit_identical(fp8_dtype):
    """PTX's cvt.rn.satfinite is the clamp: specials, the limit's neighbours and random values."""
    limit = fp8.fp8_max(fp8_dtype)
    specials = [float("inf"), float("-inf"), float("nan"), 3e38, -3e38, limit, -limit, limit * 1.0625, limit * 1.125]
    specials += [1e-45, -1e-45, 2.0**-20, 0.0, -0.0]
    x = torch.cat([torch.tensor(specials), torch.randn(4096 * 64 - len(specials)) * 300]).cuda().reshape(64, -1)
    scale = torch.tensor(1.0, device="cuda")

    def quantize(x, s):
        return per_tensor.quantize(x, s, fp8_dtype, transpose=False)

    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_post_pass=SaturatingCast(), fx_graph_cache=False):
        out, code = run_and_get_code(torch.compile(quantize, dynamic=False), x, scale)
    assert "maximum" not in "".join(code) and "minimum" not in "".join(code)
    assert torch.equal(out.view(torch.uint8), quantize(x, scale).view(torch.uint8))


@pytest.mark.gpu
def test_graphquant_tensorwise_on_cuda_computes_the_same_bits_with_fewer_clamps(monkeypatch):
    """A tensorwise MLP's forward and backward with the pass and without it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.SiLU(), torch.nn.Linear(512, 256)).cuda().bfloat16()
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)

    def run():
        torch._dynamo.reset()
        compiled = graphquant.compile(copy.deepcopy(model), zoo.recipe("tensorwise"))
        inputs = x.clone().requires_grad_()

        def step():
            out = compiled(inputs)
            out.float().square().sum().backward()
            return out

        with inductor_config.patch(force_disable_caches=True):
            out, code = run_and_get_code(step)
        grads = [inputs.grad, *(p.grad for p in compiled.parameters())]
        return [out, *grads], "".join(code).count("triton_helpers.minimum")

    with_pass, clamps = run()
    monkeypatch.setattr(saturating_cast, "drop_saturated_clamps", lambda graph: 0)
    without_pass, clamps_without = run()
    assert clamps < clamps_without
    for a, b in zip(with_pass, without_pass):
        assert torch.equal(a, b)
