"""Inference: only fprop GEMMs, no columnwise representation, weights quantized once per version.

The graphs are inspected through an aot_autograd inner backend that keeps what it compiles;
under torch.no_grad that is one inference graph. Every graphquant::gemm node names the
directions of its operands; every graphquant::quantize / dequantize node its direction.
"""

import copy

import models
import pytest
import torch
from reference import GemmTape, Reference, assert_same_results, fresh_dynamo  # noqa: F401

import graphquant
from graphquant import recipes, zoo


class KeepGraphs:
    def __init__(self):
        self.graphs = []

    @property
    def backend(self):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        def compiler(gm, example_inputs):
            self.graphs.append(gm)
            return make_boxed_func(gm.forward)

        return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


def graphquant_calls(gm):
    """(op name, string arguments) of every graphquant op node."""
    return [
        (str(n.target), [a for a in n.args if isinstance(a, str)])
        for n in gm.graph.nodes
        if n.op == "call_function" and str(n.target).startswith("graphquant.")
    ]


def x3(batch=2, seq=32, dim=64, seed=0):
    return torch.randn(batch, seq, dim, generator=torch.Generator().manual_seed(seed))


RECIPES = {
    "mxfp8": recipes.mxfp8_block_scaling,
    "nvfp4": recipes.nvfp4_block_scaling,
    "hybrid_zoo": lambda: zoo.recipe("mxfp8_fwd_high_precision_bwd"),  # rowwise_dequantized sources
}


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_no_grad_plans_fprop_only_and_makes_no_columnwise(recipe_name):
    model = models.seeded(models.MLP())
    keep = KeepGraphs()
    compiled = graphquant.compile(model, RECIPES[recipe_name](), backend=keep.backend, fullgraph=True)
    with torch.no_grad():
        y = compiled(x3())
    plan = compiled.graphquant.plan
    assert [(g.site, g.gemm) for g in plan.gemms] == [("fc1#0", "fprop"), ("fc2#0", "fprop")]
    assert len(keep.graphs) == 1  # no backward graph
    calls = graphquant_calls(keep.graphs[0])
    gemms = [args for op, args in calls if op.startswith("graphquant.gemm")]
    assert len(gemms) == 2
    assert all(args.count("rowwise") == 2 and "columnwise" not in args for args in gemms), gemms
    for op, args in calls:
        assert "columnwise" not in args, (op, args)
        assert not op.startswith("graphquant.dequantize"), op  # no rowwise_dequantized source made

    # and it computes the reference's fprop (teacher-forced: see test_compile_numerics)
    torch._dynamo.reset()
    tape = GemmTape()
    forced = graphquant.compile(copy.deepcopy(model), RECIPES[recipe_name](), backend=tape.backend, fullgraph=True)
    reference = Reference(copy.deepcopy(model), RECIPES[recipe_name](), tape=tape)
    with torch.no_grad():
        actual = {"output": forced(x3())}
        expected = {"output": reference(x3())}
    tape.assert_all_taken()
    assert_same_results(actual, expected)
    assert torch.equal(y, actual["output"])


@pytest.mark.filterwarnings("ignore:graphquant.compile.*mode='inference'.*makes no backward")
@pytest.mark.parametrize("how", ["no_grad", "inference_mode", "mode"])
def test_each_weight_quantized_once_per_version(how):
    """torch.no_grad, torch.inference_mode, or mode="inference" with grad enabled."""
    model = models.seeded(models.MLP())
    ref_model = copy.deepcopy(model)
    kwargs = {"mode": "inference"} if how == "mode" else {}
    tape = GemmTape()
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend=tape.backend, fullgraph=True, **kwargs)
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "mode": torch.enable_grad}[how]
    cache = compiled.graphquant.weight_cache
    with context():
        for seed in range(3):
            compiled(x3(seed=seed))
        assert cache.quantizations == 2  # fc1.weight and fc2.weight, once each
        with torch.no_grad():
            model.fc1.weight.mul_(0.5)  # an in-place update: a new version of fc1.weight
            ref_model.fc1.weight.mul_(0.5)
        tape.clear()
        y = compiled(x3(seed=9))
        assert cache.quantizations == 3  # fc1.weight again, fc2.weight still cached
    # the updated weight is the one used: the teacher-forced reference on the updated weights
    reference = Reference(ref_model, recipes.mxfp8_block_scaling(), tape=tape)
    with torch.no_grad():
        expected = reference(x3(seed=9))
    tape.assert_all_taken()
    assert_same_results({"output": y.detach()}, {"output": expected})
    with context():
        compiled(x3(seed=10))
    assert cache.quantizations == 3
    assert len(compiled.graphquant.plans) == 1


def test_training_after_inference_quantizes_in_graph():
    """Weight caching is an inference matter: a training step quantizes weights in the graph and
    leaves the cache alone."""
    model = models.seeded(models.MLP())
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        compiled(x3())
    compiled(x3().requires_grad_()).sum().backward()
    assert compiled.graphquant.weight_cache.quantizations == 2
    assert [g.gemm for g in compiled.graphquant.plan.gemms] == ["fprop", "dgrad", "wgrad"] * 2
