"""Inference: only fprop GEMMs, no columnwise representation, weights quantized from their
current values on every call.

The graphs are inspected through an aot_autograd inner backend that keeps what it compiles;
under torch.no_grad that is one inference graph. Every graphquant::gemm node names the
directions of its operands; every graphquant::quantize / dequantize node its direction.
"""

import copy
import gc
import re

import models
import pytest
import torch
from reference import GemmTape, Reference, assert_same_results, fresh_dynamo  # noqa: F401

import graphquant
from graphquant import recipes, zoo
from graphquant.formats import fp8


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
def test_each_call_uses_the_weights_as_they_are(how):
    """torch.no_grad, torch.inference_mode, or mode="inference" with grad enabled."""
    model = models.seeded(models.MLP())
    ref_model = copy.deepcopy(model)
    kwargs = {"mode": "inference"} if how == "mode" else {}
    tape = GemmTape()
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend=tape.backend, fullgraph=True, **kwargs)
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "mode": torch.enable_grad}[how]
    with context():
        for seed in range(3):
            compiled(x3(seed=seed))
        with torch.no_grad():
            model.fc1.weight.mul_(0.5)  # an in-place update: a new version of fc1.weight
            ref_model.fc1.weight.mul_(0.5)
        tape.clear()
        y = compiled(x3(seed=9))
    # the updated weight is the one used: the teacher-forced reference on the updated weights
    reference = Reference(ref_model, recipes.mxfp8_block_scaling(), tape=tape)
    with torch.no_grad():
        expected = reference(x3(seed=9))
    tape.assert_all_taken()
    assert_same_results({"output": y.detach()}, {"output": expected})
    assert len(compiled.graphquant.plans) == 1


def _fused_adam_step(weight):
    weight.grad = torch.ones_like(weight)
    torch.optim.Adam([weight], lr=0.1, fused=True).step()


# Writes that move no version counter of the parameter: through .data (EMA updates, hand-written
# optimizers, weight syncs), a new tensor behind .data on the same memory, a fused optimizer step.
WRITES = {
    "data_mul": lambda w: w.data.mul_(2),
    "data_copy": lambda w: w.data.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(5))),
    "data_transposed": lambda w: setattr(w, "data", w.data.t()),
    "fused_adam": _fused_adam_step,
}


@pytest.mark.parametrize("write", sorted(WRITES))
def test_no_write_to_a_weight_is_missed(write):
    """A quantized weight never outlives the values it was made from, whatever wrote them."""
    model = models.seeded(models.MLP(hidden=64))  # square weights, so a transposed one fits
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager")
    x = x3()
    with torch.no_grad():
        before = compiled(x)
    WRITES[write](model.fc1.weight)
    with torch.no_grad():
        after = compiled(x)
        expected = graphquant.compile(copy.deepcopy(model), recipes.mxfp8_block_scaling(), backend="aot_eager")(x)
    assert not torch.equal(after, before)
    assert torch.equal(after, expected)


def _live_cpu_tensor_bytes():
    """Bytes of every CPU tensor storage that something still holds."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_reloading_weights_keeps_nothing_of_the_old_ones():
    """load_state_dict(assign=True) 40 times: nothing made from the replaced weights stays alive."""
    model = models.seeded(models.MLP())
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager")
    x = x3()
    checkpoints = [models.seeded(models.MLP(), seed).state_dict() for seed in range(2)]

    def reload(seed):
        model.load_state_dict({k: v.clone() for k, v in checkpoints[seed % 2].items()}, assign=True)
        with torch.no_grad():
            return compiled(x)

    first = [reload(0), reload(1)]
    held = _live_cpu_tensor_bytes()
    for seed in range(40):
        assert torch.equal(reload(seed), first[seed % 2])
    assert _live_cpu_tensor_bytes() == held


def test_training_after_inference_quantizes_in_graph():
    """After an inference graph, a training step gets a graph of its own with all three GEMMs."""
    model = models.seeded(models.MLP())
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        compiled(x3())
    compiled(x3().requires_grad_()).sum().backward()
    assert [g.gemm for g in compiled.graphquant.plan.gemms] == ["fprop", "dgrad", "wgrad"] * 2


def _casts_to_fp8(node: torch.fx.Node) -> bool:
    """Whether ``node`` casts to FP8: once a traced FP8 quantize, whose scales are plain ops."""
    return node.target == torch.ops.prims.convert_element_type.default and node.args[1] in fp8.FP8_DTYPES.values()


class _Captured(Exception):
    """Stops Inductor once the post-grad graph is in hand: the test needs no C++ build."""


@pytest.mark.parametrize("recipe_name", ["tensorwise", "rowwise", "deepseek_blockwise", "mxfp8"])
def test_inductor_quantizes_a_tensor_read_by_two_linears_once(recipe_name):
    """A SwiGLU's gate and up projections read one x: the graph Inductor lowers quantizes it once
    (as a training graph does after AOTAutograd's partitioner merges the two), not once a linear."""
    from torch._inductor import config as inductor_config

    recipe = recipes.mxfp8_block_scaling() if recipe_name == "mxfp8" else zoo.recipe(recipe_name)
    graphs = []

    def capture(graph):
        graphs.append(graph)
        raise _Captured

    compiled = graphquant.compile(models.SwiGLU(128, 256).to(torch.bfloat16), recipe, mode="inference")
    with inductor_config.patch(post_grad_custom_post_pass=capture, fx_graph_cache=False), torch.no_grad():
        with pytest.raises(Exception):  # _Captured, as this torch's Inductor and Dynamo wrap it
            compiled(torch.randn(32, 128, dtype=torch.bfloat16))
    (graph,) = graphs
    ops = torch.ops.graphquant
    quantize_ops = (ops.quantize.default, ops.e8m0_scales.default)  # MXFP8's casts follow its scales op
    quantizes = [n for n in graph.nodes if n.target in quantize_ops or (recipe_name != "mxfp8" and _casts_to_fp8(n))]
    assert len(quantizes) == 5, graph  # the three weights, x once, and the down projection's input


@pytest.mark.parametrize(
    "recipe_name, frozen, scale_op, divisions",
    [
        ("tensorwise", True, False, True),
        ("rowwise", True, False, False),  # power-of-two scales: the amax's bits
        ("deepseek_blockwise", True, False, True),  # x's 1x128 blocks
        ("deepseek_blockwise", False, True, True),  # and the weights' 128x128 tiles, by the op
    ],
)
def test_fp8_scales_reach_inductor_as_traced_scales_spells_them(recipe_name, frozen, scale_op, divisions):
    """Inductor sees a tensor's one scale and the scales of blocks along rows as float64
    divisions, power-of-two scales as integer ops on the amax's bits (plain ops it fuses), and
    scales of 128x128 tiles through graphquant::fp8_scales, computed once each
    (float8.traced_scales)."""
    from torch._inductor import config as inductor_config

    graphs = []

    def capture(graph):
        graphs.append(graph)
        raise _Captured

    compiled = graphquant.compile(models.SwiGLU(128, 256).to(torch.bfloat16), zoo.recipe(recipe_name), mode="inference")
    if frozen:
        graphquant.freeze(compiled)
    with inductor_config.patch(post_grad_custom_post_pass=capture, fx_graph_cache=False), torch.no_grad():
        with pytest.raises(Exception):  # _Captured
            compiled(torch.randn(32, 128, dtype=torch.bfloat16))
    (graph,) = graphs
    targets = [n.target for n in graph.nodes]
    float64_divisions = [n for n in graph.nodes if n.target == torch.ops.aten.div.Tensor and n.meta["val"].dtype == torch.float64]
    assert (torch.ops.graphquant.fp8_scales.default in targets) == scale_op, graph
    assert bool(float64_divisions) == divisions, graph
    if recipe_name == "rowwise":
        assert torch.ops.aten.view.dtype in targets, graph


@pytest.mark.parametrize("recipe_name", ["tensorwise", "rowwise", "deepseek_blockwise", "mxfp8"])
def test_inductor_writes_the_codes_two_gemms_share_once(recipe_name):
    """A frozen SwiGLU's gate and up projections read one x's codes from one buffer: Inductor
    realizes an operand several of graphquant's ops read once (as it does aten.mm's), rather than
    copying it into a buffer for each op (per-tensor scaling's codes were written twice)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    recipe = recipes.mxfp8_block_scaling() if recipe_name == "mxfp8" else zoo.recipe(recipe_name)
    model = torch.nn.Sequential(models.RMSNorm(128), models.SwiGLU(128, 256)).to(torch.bfloat16)
    compiled = graphquant.freeze(graphquant.compile(model, recipe, mode="inference", dynamic=False))
    with inductor_config.patch(fx_graph_cache=False), torch.no_grad():
        _, code = run_and_get_code(compiled, torch.randn(64, 128, dtype=torch.bfloat16))
    x_codes = re.findall(r"empty_strided_\w+\(\(64, (?:128|4, 32)\), [^\n]*float8_e4m3fn\)", "\n".join(code))
    assert len(x_codes) == 1, x_codes


class Conv1D(torch.nn.Module):
    """transformers' GPT-2 projection: torch.addmm with the weight (in, out) on the right, a linear
    site that a graph runs through QuantizedGemm rather than the inference formula."""

    def __init__(self, d_in=64, d_out=96):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d_in, d_out) / d_in**0.5)
        self.bias = torch.nn.Parameter(torch.zeros(d_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], -1)


@pytest.mark.filterwarnings("ignore:graphquant.compile.*mode='inference'.*makes no backward")
@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_a_graph_without_backward_quantizes_no_columnwise_for_a_parameter_on_the_right(recipe_name):
    """Two rows (a decode step) tile no 32-row columnwise block: the plan asked for none."""
    keep = KeepGraphs()
    compiled = graphquant.compile(models.seeded(Conv1D()), RECIPES[recipe_name](), backend=keep.backend, mode="inference")
    with torch.no_grad():
        compiled(x3(batch=1, seq=2))
    assert all("columnwise" not in args for _, args in graphquant_calls(keep.graphs[0]))
    y = compiled(x3(batch=1, seq=32))  # grad enabled: the graph still runs no backward
    with pytest.raises(RuntimeError, match=r"backward through linear.0#0, a GEMM of a graph compiled to run no backward"):
        y.sum().backward()


def test_an_evaluation_call_draws_nothing_and_leaves_the_rounding_step():
    """NVFP4 rounds grad_output stochastically; a no_grad call multiplies fprop alone, so it must
    not move the step, or evaluating between steps would change the training run."""
    compiled = graphquant.compile(models.seeded(models.MLP()), recipes.nvfp4_block_scaling(), backend="aot_eager")
    compiled(x3()).sum().backward()
    step = compiled.graphquant.run_state.rng.clone()
    with torch.no_grad():
        compiled(x3())
        compiled(x3(seed=1))
    assert torch.equal(compiled.graphquant.run_state.rng, step)
    compiled(x3()).sum().backward()
    assert compiled.graphquant.run_state.rng.tolist() == [step[0].item(), step[1].item() + 1]


def test_threads_making_the_first_call_at_once_compile_one_graph():
    """A server's threads warming a model up at once each compiled a graph of their own in Dynamo
    (past its recompile limit, graphquant refused the rest): they take the first call in turn
    now, one graph is compiled, and every thread gets the sequential call's output."""
    import threading

    model = models.seeded(models.MLP())
    expected = graphquant.compile(copy.deepcopy(model), recipes.current_scaling(), backend="aot_eager", mode="inference")
    compiled = graphquant.compile(model, recipes.current_scaling(), backend="aot_eager", mode="inference")
    xs = [x3(seed=seed) for seed in range(6)]
    start, outputs, errors = threading.Barrier(len(xs)), {}, []

    def first_call(i):
        start.wait()
        try:
            with torch.inference_mode():
                outputs[i] = compiled(xs[i])
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=first_call, args=(i,)) for i in range(len(xs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and len(compiled.graphquant.plans) == 1
    with torch.inference_mode():
        for i, x in enumerate(xs):
            assert torch.equal(outputs[i], expected(x)), i
