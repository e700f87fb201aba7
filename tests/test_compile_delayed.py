"""Delayed scaling: the slot state updates inside the compiled graph, step after step.

The reference keeps its own state per slot and applies TE's rule itself
(reference.delayed_update: history[0] = amax; amax_used = max(history) or history[0];
scale = fp8_max / amax_used / 2^margin; roll the history and zero slot 0), after each quantize
of the slot; a step's quantize uses the scale left by the previous step. Inputs and upstream
gradients change scale from step to step, so every scale is different and wrong ones show.
"""

import copy
import dataclasses
import warnings
import itertools

import models
import pytest
import torch
from reference import (  # noqa: F401
    GemmTape,
    Reference,
    StaticInputs,
    assert_same_results,
    forward_backward,
    fresh_dynamo,
)

import graphquant
from graphquant import recipes
from graphquant.quantizers import Float8DelayedScalingQuantizer


def teacher_forced(model, recipe):
    """(compiled model, its reference, the tape that teacher-forces the reference's GEMMs)."""
    tape = GemmTape()
    compiled = graphquant.compile(model, recipe, backend=tape.backend, fullgraph=True)
    return compiled, Reference(copy.deepcopy(model), recipe, tape=tape), tape


def same_step(compiled, reference, tape, step):
    """One training step of both on step_input(step): the same outputs and gradients."""
    tape.clear()
    x = step_input(step)
    actual = forward_backward(compiled, compiled._orig_mod, x, grad_seed=step)
    expected = forward_backward(reference, reference.model, x, grad_seed=step)
    tape.assert_all_taken()
    assert_same_results(actual, expected, what=f"step {step}: ")


def step_input(step):
    return torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(step)) * (1.0 + step)


@pytest.mark.parametrize("algo, history", [("max", 3), ("most_recent", 2)])
def test_delayed_state_updates_in_graph_and_matches_eager_rule(algo, history):
    recipe = recipes.delayed_scaling(amax_history_len=history, amax_compute_algo=algo, margin=1)
    model = models.seeded(models.MLP())
    compiled, reference, tape = teacher_forced(model, recipe)
    state = compiled.graphquant.run_state.delayed
    scales_seen = []
    for step in range(4):
        same_step(compiled, reference, tape, step)

        assert set(state) == set(reference.delayed)
        for role, tensor in state.items():
            quantizer = compiled.graphquant.plan.quantizer(role)
            assert isinstance(quantizer, Float8DelayedScalingQuantizer)
            assert quantizer.fp8_dtype == ("e5m2" if role.tensor_type == "grad_output" else "e4m3")
            scale, amax_history = reference.delayed[role]
            assert tensor.shape == (1 + history,)
            assert torch.equal(tensor[:1], scale), (step, str(role), tensor.tolist(), scale.tolist())
            assert torch.equal(tensor[1:], amax_history), (step, str(role), tensor.tolist(), amax_history.tolist())
        scales_seen.append({str(r): t[0].item() for r, t in state.items()})
    # fc1's input grows every step, so its scale moves every step (grad_output slots: below)
    fc1_input = "module_type=linear|tensor_type=input|name=fc1"
    for before, after in itertools.pairwise(scales_seen):
        assert before[fc1_input] != after[fc1_input], (before, after)
    assert len(compiled.graphquant.plans) == 1  # one graph: the state is updated inside it
    assert {r.tensor_type for r in state} == {"input", "weight", "grad_output"}


def test_slot_states_are_static_inputs_and_the_rounding_step_is_not():
    """CUDA graph trees copy every input AOT does not call static into the graph's memory at each
    replay, and run a graph that mutates such an input without CUDA graphs: a delayed-scaling
    slot's state, rolled in place at every call, is the same tensor for the model's life, so it is
    static; the stochastic-rounding [seed, step] is a new tensor each call, so it is not."""
    static = StaticInputs()
    compiled = graphquant.compile(models.seeded(models.MLP()), recipes.delayed_scaling(amax_history_len=2), backend=static.backend)
    compiled(step_input(0)).sum().backward()
    forward_states = {t.data_ptr() for r, t in compiled.graphquant.run_state.delayed.items() if r.tensor_type != "grad_output"}
    assert len(forward_states) == 4 and forward_states <= static.static

    static = StaticInputs()
    compiled = graphquant.compile(models.seeded(models.MLP()), recipes.nvfp4_block_scaling(), backend=static.backend)
    compiled(step_input(0)).sum().backward()
    assert compiled.graphquant.run_state.rng.data_ptr() in static.given - static.static


def check_states(compiled, reference, step, roles=None):
    state = compiled.graphquant.run_state.delayed
    roles = set(state) if roles is None else roles
    for role in roles:
        tensor = state[role]
        scale, amax_history = reference.delayed[role]
        assert torch.equal(tensor[:1], scale), (step, str(role), tensor.tolist(), scale.tolist())
        assert torch.equal(tensor[1:], amax_history), (step, str(role), tensor.tolist(), amax_history.tolist())


def test_forward_slots_update_across_steps():
    """Forward only (no backward, grad enabled): the input and weight slots of both linears roll
    their histories and scales, and the outputs follow the reference step by step."""
    recipe = recipes.delayed_scaling(amax_history_len=3)
    model = models.seeded(models.MLP())
    compiled, reference, tape = teacher_forced(model, recipe)
    for step in range(4):
        tape.clear()
        x = step_input(step)
        y = compiled(x)
        y_ref = reference(x)
        tape.assert_all_taken()
        assert_same_results({"output": y.detach()}, {"output": y_ref.detach()}, what=f"step {step}: ")
        forward_roles = {r for r in compiled.graphquant.run_state.delayed if r.tensor_type != "grad_output"}
        assert len(forward_roles) == 4
        check_states(compiled, reference, step, forward_roles)
    assert len(compiled.graphquant.plans) == 1


def test_grad_output_slot_updates_across_steps():
    """A single linear whose input needs no gradient: backward quantizes only grad_output (for
    wgrad), which is the upstream gradient itself; its slot follows the rule step by step."""
    recipe = recipes.delayed_scaling(amax_history_len=2, amax_compute_algo="max")
    model = models.seeded(torch.nn.Linear(64, 64))
    compiled = graphquant.compile(model, recipe, backend="aot_eager", fullgraph=True)
    reference = Reference(copy.deepcopy(model), recipe)
    g_role = None
    for step in range(4):
        x = step_input(step)
        compiled(x).backward(torch.full((2, 32, 64), 0.5 * (step + 1)))
        reference(x).backward(torch.full((2, 32, 64), 0.5 * (step + 1)))
        g_role = next(r for r in compiled.graphquant.run_state.delayed if r.tensor_type == "grad_output")
        check_states(compiled, reference, step, {g_role})
        # |dy| grows every step, so the history's max is this step's amax
        assert compiled.graphquant.run_state.delayed[g_role][0].item() == pytest.approx(57344.0 / (0.5 * (step + 1)), rel=1e-6)


def test_delayed_scaling_first_step_uses_scale_one():
    """A fresh slot quantizes with scale 1 (TE's initial state). Inputs of size ~1e-6 are then
    below E4M3's smallest subnormal (2^-9) and quantize to zero, so every token's output is the
    same function of the biases; the second step's scale (448 / amax / 2^margin) resolves them."""
    model = models.seeded(models.MLP())
    compiled = graphquant.compile(model, recipes.delayed_scaling(amax_history_len=4), backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0)) * 1e-6
    with torch.no_grad():
        first = compiled(x).reshape(-1, 64)
        second = compiled(x).reshape(-1, 64)
    assert torch.equal(first, first[:1].expand_as(first))
    assert not torch.equal(second, second[:1].expand_as(second))
    role = next(r for r in compiled.graphquant.run_state.delayed if r.name == "fc1" and r.tensor_type == "input")
    assert compiled.graphquant.run_state.delayed[role][0].item() == pytest.approx(448.0 / x.abs().max().item(), rel=1e-6)


def test_gradients_under_e5m2s_smallest_reach_each_layer_one_step_later_than_the_one_above():
    """TE's rule read through a stack: a first step's gradient below E5M2's smallest subnormal
    (2^-16) at scale 1 flushes to zero, so the layer below sees a zero gradient, records amax 0 and
    keeps scale 1 for another step (README: delayed scaling's first steps). fc2's weight gradient
    appears at the second step, fc1's, one GEMM further from the loss, at the third."""
    model = models.seeded(models.MLP())
    compiled = graphquant.compile(model, recipes.delayed_scaling(amax_history_len=4), backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0))
    nonzero = []
    for _ in range(3):
        model.zero_grad()
        (compiled(x).sum() * 1e-9).backward()
        nonzero.append(tuple(bool(layer.weight.grad.any()) for layer in (model.fc1, model.fc2)))
    assert nonzero == [(False, False), (False, True), (True, True)]


def test_a_module_called_twice_updates_its_slots_once_a_step():
    """fc runs twice a step: both calls quantize each slot with the step's one scale, and the
    slot takes one history entry a step, the larger amax, as TE's (each call had rolled it, so
    the second quantized with a scale made from the first's amax and clipped). Its grad_output
    slot is quantized by both backwards, the later call's first (autograd's saved-tensor check
    must not stand in the way), and the steps follow the reference."""
    recipe = recipes.delayed_scaling(amax_history_len=4)
    model = models.seeded(models.SharedLinear())
    compiled, reference, tape = teacher_forced(model, recipe)
    for step in range(3):
        same_step(compiled, reference, tape, step)
        check_states(compiled, reference, step)
        fc_slots = [state for role, state in compiled.graphquant.run_state.delayed.items() if role.name == "fc"]
        assert [int((state[1:] > 0).sum()) for state in fc_slots] == [step + 1] * 3  # input, weight, grad_output


class _FrozenTwice(torch.nn.Module):
    """fc, frozen, on the input (no backward: nothing before it takes a gradient) and on g's output."""

    def __init__(self):
        super().__init__()
        self.fc, self.g = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
        self.fc.requires_grad_(False)

    def forward(self, x):
        return self.fc(x) + self.fc(self.g(x))


def test_a_gradient_slot_whose_first_call_runs_no_backward_rolls_at_the_call_that_does():
    """The backward runs a slot's calls in reverse order, so its first call's ends the step; fc's
    first call runs no backward, so the second's ends it (had the first been the one, its
    grad_output slot would have recorded for ever at scale 1)."""
    compiled = graphquant.compile(models.seeded(_FrozenTwice()), recipes.delayed_scaling(amax_history_len=4), backend="aot_eager")
    for step in range(3):
        compiled(step_input(step)).sum().backward()
        state = next(s for r, s in compiled.graphquant.run_state.delayed.items() if r.name == "fc" and r.tensor_type == "grad_output")
        assert state[0] != 1 and state[1] == 0 and int((state[2:] > 0).sum()) == step + 1


def test_an_attention_called_twice_a_step_takes_one_history_entry_a_step():
    """A decoder block run twice: each slot of its linears and of its attention (qkv, do, dp)
    quantizes both calls of a step with one scale and takes one history entry a step."""
    recipe = dataclasses.replace(recipes.delayed_scaling(amax_history_len=4), fp8_dpa=True)
    block = models.seeded(models.DecoderBlock(attention="sdpa"))
    compiled = graphquant.compile(torch.nn.Sequential(block, block), recipe, backend="aot_eager")
    for step in range(3):
        compiled(step_input(step)).sum().backward()
        entries = {str(r): int((s[1:] > 0).sum()) for r, s in compiled.graphquant.run_state.delayed.items()}
        assert {r for r in entries if "dpa" in r} >= {f"module_type=dpa|tensor_type={t}|name=0.attn" for t in ("qkv", "do", "dp")}
        assert set(entries.values()) == {step + 1}, entries


def test_an_inference_call_warns_where_it_starts_delayed_slots_at_scale_one():
    """TE's first step quantizes at scale 1, which a training run outgrows; an inference call
    that starts a slot so says it, unless the slot's state was loaded or a call already made it."""
    recipe = recipes.delayed_scaling(amax_history_len=2)
    trained = graphquant.compile(models.seeded(models.MLP()), recipe, backend="aot_eager")
    trained(step_input(0)).sum().backward()
    state = trained.graphquant.state_dict()

    fresh = graphquant.compile(models.seeded(models.MLP()), recipe, backend="aot_eager")
    with torch.no_grad():
        with pytest.warns(UserWarning, match=r"starts 4 delayed-scaling slot\(s\) with no amax history .* at scale 1"):
            fresh(step_input(0))
        fresh(step_input(0) * 2)  # a recompile for new shapes would not warn either: the slots have a history
    loaded = graphquant.compile(models.seeded(models.MLP()), recipe, backend="aot_eager")
    loaded.graphquant.load_state_dict(state)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded(step_input(0))


class _TwoWeightsThroughOneHelper(torch.nn.Module):
    """Two products through one helper, whose graph break makes Dynamo compile it again for the
    second weight: both compiles name their product linear.0#0."""

    def __init__(self, breaks: bool):
        super().__init__()
        self.breaks = breaks
        self.w1 = torch.nn.Parameter(torch.randn(64, 64) / 8)
        self.w2 = torch.nn.Parameter(torch.randn(64, 64) * 4)

    def project(self, x, w):
        y = torch.nn.functional.linear(x, w)
        if self.breaks:
            torch._dynamo.graph_break()
        return y

    def forward(self, x):
        return self.project(torch.relu(self.project(x, self.w1)), self.w2)


@pytest.mark.parametrize("breaks", [False, True])
def test_one_name_for_delayed_sites_of_two_graphs_of_one_forward_is_warned_of(fresh_dynamo, breaks):
    """A helper that breaks its graph, called with two weights, makes one site of both products,
    whose slots then share one scale history: the compile says so; without the break it has two."""
    compiled = graphquant.compile(_TwoWeightsThroughOneHelper(breaks), recipes.delayed_scaling(), backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.randn(32, 64))
    warned = [str(w.message) for w in caught if "compiled again in this forward call" in str(w.message)]
    sites = sorted({g.site for g in compiled.graphquant.plan.gemms})
    if breaks:
        assert sites == ["linear.0#0"] and len(warned) == 1 and warned[0].startswith("graphquant: linear.0#0 name products"), (sites, warned)
    else:
        assert sites == ["linear.0#0", "linear.1#0"] and not warned, (sites, warned)
