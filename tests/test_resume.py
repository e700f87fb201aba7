"""Resume: a run stopped at a checkpoint and continued from it with a fresh model, optimizer and
compile continues bit for bit as the uninterrupted run, delayed-scaling histories and the
stochastic-rounding step included (``compiled.graphquant.state_dict()``, saved beside the
model's own state_dict, which stays the plain weights).
"""

import copy
import json
import re
import warnings

import models
import pytest
import torch
import torch.nn.functional as F
from reference import fresh_dynamo  # noqa: F401  (autouse)

import graphquant
from graphquant import recipes
from graphquant.run_state import SCALINGS

RECIPES = {
    "delayed_scaling": lambda seed=0: (recipes.delayed_scaling(amax_history_len=4), seed),
    "nvfp4_stochastic_rounding": lambda seed=0: (recipes.nvfp4_block_scaling(), seed),
}


def batch(step):
    """Inputs whose scale changes every step, so a delayed-scaling history that restarts shows."""
    return torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(step)) * (1.0 + step)


def start(model, recipe_name, seed=0):
    torch._dynamo.reset()
    recipe, seed = RECIPES[recipe_name](seed)
    compiled = graphquant.compile(model, recipe, backend="aot_eager", seed=seed)
    return compiled, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(compiled, optimizer, steps):
    losses = []
    for step in steps:
        optimizer.zero_grad()
        loss = compiled(batch(step)).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def same_state(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_resumed_run_continues_bit_for_bit(recipe_name, tmp_path):
    """Train 3 steps, checkpoint, train 3 more; a fresh model, optimizer and compile loaded from the
    checkpoint (torch.load(weights_only=True)) before its first call gives the same 3 losses and
    weights, bit for bit. Resumed without graphquant's state it does not, so the state matters."""
    model = models.seeded(models.MLP(), 0)
    compiled, optimizer = start(model, recipe_name)
    train(compiled, optimizer, range(3))
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "graphquant": compiled.graphquant.state_dict()}
    torch.save(checkpoint, tmp_path / "checkpoint.pt")
    expected_losses = train(compiled, optimizer, range(3, 6))

    def resume(with_graphquant_state):
        saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
        resumed_model = models.MLP()
        resumed_model.load_state_dict(saved["model"])  # the weights alone load into a plain model
        resumed, resumed_optimizer = start(resumed_model, recipe_name)
        resumed_optimizer.load_state_dict(saved["optimizer"])
        if with_graphquant_state:
            resumed.graphquant.load_state_dict(saved["graphquant"])
            # entries wait for their slots, and a checkpoint taken now would keep them
            assert same_state(resumed.graphquant.state_dict(), saved["graphquant"])
        return train(resumed, resumed_optimizer, range(3, 6)), resumed_model

    losses, resumed_model = resume(with_graphquant_state=True)
    assert torch.equal(losses, expected_losses), (losses, expected_losses)
    for name, value in model.state_dict().items():
        assert torch.equal(resumed_model.state_dict()[name], value), name

    restarted_losses, _ = resume(with_graphquant_state=False)
    assert not torch.equal(restarted_losses, expected_losses)


def test_state_dict_holds_each_delayed_slot_and_the_step():
    """Keys are the slots' role strings and "rng"; values are copies, taken now."""
    model = models.seeded(models.MLP(), 0)
    compiled, optimizer = start(model, "delayed_scaling")
    train(compiled, optimizer, range(2))
    state = compiled.graphquant.state_dict()
    slots = {str(role) for role in compiled.graphquant.run_state.delayed}
    assert set(state) == slots | {SCALINGS} and len(slots) == 6  # fc1 and fc2: input, weight, grad_output
    scalings = json.loads(bytes(state[SCALINGS].tolist()))
    assert scalings["module_type=linear|tensor_type=grad_output|name=fc2"] == "fp8_dtype=e5m2, margin=0, amax_compute_algo=max"
    assert scalings.keys() == slots
    role = next(r for r in compiled.graphquant.run_state.delayed if str(r) == "module_type=linear|tensor_type=input|name=fc1")
    assert torch.equal(state[str(role)], compiled.graphquant.run_state.delayed[role])
    train(compiled, optimizer, range(2, 3))
    assert not torch.equal(state[str(role)], compiled.graphquant.run_state.delayed[role])  # a copy, not the live state

    sr_model = models.seeded(models.MLP(), 0)
    sr, sr_optimizer = start(sr_model, "nvfp4_stochastic_rounding", seed=7)
    train(sr, sr_optimizer, range(2))
    assert sr.graphquant.state_dict().keys() == {"rng"}
    assert sr.graphquant.state_dict()["rng"].tolist() == [7, 2]  # seed 7, two steps taken


class AuxiliaryProduct(torch.nn.Module):
    """A training-only functional product (an auxiliary loss term) before the main one: a module's
    functional products are numbered in the order its graphs first meet them."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(64, 128), torch.nn.Linear(64, 128)

    def forward(self, x):
        h, k = torch.nn.functional.gelu(self.fc1(x)), self.fc2(x)
        aux = torch.matmul(h * 1000.0, h.transpose(-1, -2)).mean() * 1e-6 if self.training else 0.0
        return torch.matmul(h, k.transpose(-1, -2)).square().mean() + aux


def test_a_run_resumed_with_an_evaluation_first_names_its_products_as_the_saved_run_did():
    """Resumed, the model evaluated before it trained: its evaluation graph, which skips the
    auxiliary product, numbered the main one matmul.0 and took the auxiliary's delayed-scaling
    entry (and training then the main one's): other outputs and losses, silently. The state
    carries the saved run's numbers now, so both runs go on alike, bit for bit."""
    def evaluate(compiled):
        compiled.eval()
        with torch.no_grad():
            out = compiled(batch(100))
        compiled.train()
        return out

    def steps(compiled, optimizer, numbers):
        losses = []
        for step in numbers:
            optimizer.zero_grad()
            loss = compiled(batch(step))
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        return torch.stack(losses)

    model = models.seeded(AuxiliaryProduct(), 0)
    compiled, optimizer = start(model, "delayed_scaling")
    steps(compiled, optimizer, range(3))
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()), compiled.graphquant.state_dict())
    expected = (evaluate(compiled), steps(compiled, optimizer, range(3, 5)))

    resumed_model = AuxiliaryProduct()
    resumed_model.load_state_dict(saved[0])
    resumed, resumed_optimizer = start(resumed_model, "delayed_scaling")
    resumed_optimizer.load_state_dict(saved[1])
    resumed.graphquant.load_state_dict(saved[2])
    got = (evaluate(resumed), steps(resumed, resumed_optimizer, range(3, 5)))
    assert all(map(torch.equal, got, expected)), (got, expected)
    assert same_state(resumed.graphquant.state_dict(), compiled.graphquant.state_dict())


def test_loading_into_a_model_that_ran_replaces_its_state():
    """After the first call a loaded state is copied into the live slots: the next steps continue
    from it, and a checkpoint taken right away gives it back."""
    source = models.seeded(models.MLP(), 0)
    compiled, optimizer = start(source, "delayed_scaling")
    train(compiled, optimizer, range(3))
    saved = compiled.graphquant.state_dict()

    target_model = models.seeded(models.MLP(), 0)
    target, target_optimizer = start(target_model, "delayed_scaling")
    train(target, target_optimizer, range(1))
    target.graphquant.load_state_dict(saved)
    assert same_state(target.graphquant.state_dict(), saved)


def test_loaded_state_that_does_not_match_the_plan_fails_naming_the_keys():
    model = models.seeded(models.MLP(), 0)
    compiled, optimizer = start(model, "delayed_scaling")
    train(compiled, optimizer, range(1))
    state = compiled.graphquant.state_dict()
    fc1_input = "module_type=linear|tensor_type=input|name=fc1"

    renamed = dict(state)
    renamed["module_type=linear|tensor_type=input|name=layers.0.fc1"] = renamed.pop(fc1_input)
    with pytest.raises(KeyError) as error:
        compiled.graphquant.load_state_dict(renamed)
    message = str(error.value)
    assert "unexpected ['module_type=linear|tensor_type=input|name=layers.0.fc1']" in message
    assert f"missing ['{fc1_input}']" in message
    assert "module_type=linear|tensor_type=weight|name=fc2" in message  # the plan's slots are listed

    longer = dict(state, **{fc1_input: torch.zeros(9)})  # a history of 8 instead of 4
    with pytest.raises(ValueError, match=r"'module_type=linear\|tensor_type=input\|name=fc1' is torch.float32 of shape \(9,\), but this model keeps torch.float32 of shape \(5,\)"):
        compiled.graphquant.load_state_dict(longer)
    with pytest.raises(TypeError, match="must be a tensor, got float"):
        compiled.graphquant.load_state_dict(dict(state, **{fc1_input: 1.0}))
    assert torch.equal(compiled.graphquant.state_dict()[fc1_input], state[fc1_input])  # nothing half-loaded


def test_state_for_a_slot_of_another_shape_fails_when_the_slot_is_planned():
    """Before the first call the slots are unknown; an entry that does not fit fails at the plan,
    and the other entries, which that failure kept from their slots, are not called unfit."""
    model = models.seeded(models.MLP(), 0)
    compiled, optimizer = start(model, "delayed_scaling")
    train(compiled, optimizer, range(1))
    state = compiled.graphquant.state_dict()
    resumed, resumed_optimizer = start(models.seeded(models.MLP(), 0), "delayed_scaling")
    resumed.graphquant.load_state_dict({**state, "module_type=linear|tensor_type=input|name=fc1": torch.ones(3)})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="graphquant")
        with pytest.raises(graphquant.PlanError, match="load_state_dict: .* was it saved under another recipe"):
            train(resumed, resumed_optimizer, range(1))


def test_stochastic_rounding_state_of_another_seed_fails():
    model = models.seeded(models.MLP(), 0)
    compiled, optimizer = start(model, "nvfp4_stochastic_rounding", seed=3)
    with pytest.raises(ValueError, match="streams of seed 0, but this model was compiled with seed=3"):
        compiled.graphquant.load_state_dict({"rng": torch.tensor([0, 5])})


def test_a_models_own_state_dict_is_refused_naming_its_keys():
    compiled, _ = start(models.seeded(models.MLP(), 0), "delayed_scaling")
    with pytest.raises(KeyError, match=r"slots' roles .* got \['fc1.weight', 'fc1.bias', 'fc2.weight'\] \.\.\.: load the model's own state_dict into the model"):
        compiled.graphquant.load_state_dict(models.MLP().state_dict())


@pytest.mark.parametrize("case", ["other module names", "another recipe", "a recipe that draws nothing"])
def test_loaded_entries_no_slot_takes_are_named_after_the_first_call(case):
    """Loaded before the first call, the state of a model whose modules are named otherwise (the
    same MLP wrapped in a Sequential), of a delayed-scaling run loaded into a current-scaling
    model, or a stochastic-rounding step loaded into a model whose training call draws nothing,
    would wait unused while the histories start afresh: the first call says so (the step waited
    without a word)."""
    model = models.seeded(models.MLP(), 0)
    compiled, optimizer = start(model, "nvfp4_stochastic_rounding" if case == "a recipe that draws nothing" else "delayed_scaling")
    train(compiled, optimizer, range(1))
    state = compiled.graphquant.state_dict()
    torch._dynamo.reset()
    if case == "other module names":
        resumed = graphquant.compile(torch.nn.Sequential(model), recipes.delayed_scaling(amax_history_len=4), backend="aot_eager")
    else:
        resumed = graphquant.compile(model, recipes.current_scaling(), backend="aot_eager")
    resumed.graphquant.load_state_dict(state)
    slots = [key for key in state if key != SCALINGS]
    with pytest.warns(UserWarning, match=rf"{len(slots)} of the loaded state's entries fit no slot of the graphs of this model's first call and wait unused \({re.escape(slots[0])}"):
        resumed(batch(1)).sum().backward()


def test_state_loads_after_an_inference_call_that_drew_no_random_bits():
    """An inference call draws nothing, so the stochastic-rounding step it has not made waits for
    the first training graph: loading after such a call continues as loading before it."""
    model = models.seeded(models.MLP(), 0)
    compiled, optimizer = start(model, "nvfp4_stochastic_rounding")
    train(compiled, optimizer, range(2))
    weights, state = {k: v.clone() for k, v in model.state_dict().items()}, compiled.graphquant.state_dict()
    expected = train(compiled, optimizer, range(2, 4))

    resumed_model = models.seeded(models.MLP(), 1)
    resumed_model.load_state_dict(weights)
    resumed, _ = start(resumed_model, "nvfp4_stochastic_rounding")
    sgd = torch.optim.SGD(resumed_model.parameters(), lr=0.0)  # the losses alone are compared
    with torch.no_grad():
        resumed(batch(9))
    resumed.graphquant.load_state_dict(state)
    assert torch.equal(train(resumed, sgd, range(2, 3)), expected[:1])


@pytest.mark.parametrize("corrupt", ["NaN scale", "zero scale", "infinite scale", "negative scale", "negative amax"])
def test_a_state_of_values_no_run_makes_is_refused(corrupt):
    """A slot's scale of NaN or 0 made every output non-finite at the next call, an infinite one
    quantized to nonsense, all without a word; an infinite or NaN amax in the history stays allowed
    (an overflowing or NaN fp16 gradient leaves one, and the run goes on past it)."""
    model = models.seeded(models.MLP(), 0)
    compiled, optimizer = start(model, "delayed_scaling")
    train(compiled, optimizer, range(1))
    state = compiled.graphquant.state_dict()
    key = "module_type=linear|tensor_type=weight|name=fc1"
    value = state[key].clone()
    position, number = {
        "NaN scale": (0, float("nan")), "zero scale": (0, 0.0), "infinite scale": (0, float("inf")), "negative scale": (0, -1.0),
        "negative amax": (1, -1.0),
    }[corrupt]
    value[position] = number
    match = "scale .* is finite and positive" if position == 0 else "amax history holds a negative amax"
    with pytest.raises(ValueError, match=rf"^graphquant state '{key}': .*{match}"):
        compiled.graphquant.load_state_dict({**state, key: value})
    for amax in (float("inf"), float("nan")):
        value[1] = amax
        compiled.graphquant.load_state_dict({**state, key: torch.cat([state[key][:1], value[1:]])})


def test_a_state_saved_after_a_nan_input_loads_and_resumes_as_the_run_went_on():
    """A NaN input puts a NaN amax into the delayed-scaling history; the run goes on past it, but
    its state_dict was refused by the load ("its amax history holds a NaN") for the history's length."""
    model = models.seeded(models.MLP(), 0)
    compiled = graphquant.compile(model, recipes.delayed_scaling(amax_history_len=4), backend="aot_eager")
    poisoned = torch.randn(2, 32, 64)
    poisoned[0, 0, 0] = float("nan")
    for x in (torch.randn(2, 32, 64), poisoned):
        compiled(x).sum().backward()
    state = compiled.graphquant.state_dict()
    assert any(torch.isnan(v[1:]).any() for k, v in state.items() if k != "rng")
    resumed = graphquant.compile(copy.deepcopy(model), recipes.delayed_scaling(amax_history_len=4), backend="aot_eager")
    resumed.graphquant.load_state_dict(state)
    x = torch.randn(2, 32, 64)
    assert torch.equal(resumed(x), compiled(x))
    with pytest.raises(ValueError, match=r"'rng' is \[seed, step\] with a step of 0 or more"):
        compiled.graphquant.load_state_dict({**state, "rng": torch.tensor([0, -5])})
    with pytest.raises(TypeError, match="is a mapping of names to tensors .* got list"):
        compiled.graphquant.load_state_dict([1, 2])


def test_slots_a_state_loaded_before_the_first_call_has_no_entry_for_are_said_to_start_afresh():
    """A state without one slot's entry, loaded before the first call, started that slot at scale 1
    with no history without a word: the run did not continue bit for bit."""
    model = models.seeded(models.MLP(), 0)
    compiled, optimizer = start(model, "delayed_scaling")
    train(compiled, optimizer, range(1))
    state = compiled.graphquant.state_dict()
    del state["module_type=linear|tensor_type=input|name=fc1"]
    resumed, resumed_optimizer = start(models.seeded(models.MLP(), 0), "delayed_scaling")
    resumed.graphquant.load_state_dict(state)
    with pytest.warns(UserWarning, match=r"starts 1 slot\(s\) that the loaded state has no entry for \(module_type=linear\|tensor_type=input\|name=fc1\)"):
        train(resumed, resumed_optimizer, range(1, 2))


def test_a_state_whose_scales_were_computed_for_another_format_is_refused():
    """A delayed-scaling slot's scale is (fp8_max / amax) / 2**margin of the format it was saved
    under: loaded into a model whose recipe has another margin, it quantized the next step with
    the old format's scale without a word. Refused, before the first call (at the plan) or after it
    (at once, nothing half-loaded)."""
    model = models.seeded(models.MLP(), 0)
    compiled, optimizer = start(model, "delayed_scaling")
    train(compiled, optimizer, range(2))
    state = compiled.graphquant.state_dict()
    other = recipes.delayed_scaling(amax_history_len=4, margin=1)
    refused = (
        r"'module_type=linear\|tensor_type=input\|name=fc1' holds a scale computed for fp8_dtype=e4m3, margin=0, "
        r"amax_compute_algo=max, but this model's slot computes fp8_dtype=e4m3, margin=1, amax_compute_algo=max"
    )

    torch._dynamo.reset()
    before = graphquant.compile(models.seeded(models.MLP(), 0), other, backend="aot_eager")
    before.graphquant.load_state_dict(state)
    assert same_state(before.graphquant.state_dict(), state)  # waiting entries keep what their scales are for
    with pytest.raises(graphquant.PlanError, match=refused):
        before(batch(2))

    torch._dynamo.reset()
    after = graphquant.compile(models.seeded(models.MLP(), 0), other, backend="aot_eager")
    after(batch(2)).sum().backward()
    fresh = after.graphquant.state_dict()
    with pytest.raises(ValueError, match=refused):
        after.graphquant.load_state_dict(state)
    assert same_state(after.graphquant.state_dict(), fresh)



class RoutedByBincount(torch.nn.Module):
    """fc1, then an MoE-style routing count (torch.bincount, whose output shape depends on the
    data: Dynamo breaks the graph there), then fc2: two graphs, each of which draws."""

    def __init__(self):
        super().__init__()
        self.mlp = models.MLP()

    def forward(self, x):
        h = F.gelu(self.mlp.fc1(x))
        counts = torch.bincount(h.argmax(-1).flatten(), minlength=h.shape[-1])
        return self.mlp.fc2(h) + counts.sum() * 0


def test_a_resumed_run_of_several_graphs_that_draw_continues_without_saying_it_starts_afresh():
    """The stochastic-rounding step loaded before the first call is taken by the first graph that
    draws; the graph after the break, which draws from the same step, said it started the step
    afresh (so the run would not continue bit for bit) while it continued it."""
    model = models.seeded(RoutedByBincount(), 0)
    compiled, optimizer = start(model, "nvfp4_stochastic_rounding")
    train(compiled, optimizer, range(2))
    weights, state = {k: v.clone() for k, v in model.state_dict().items()}, compiled.graphquant.state_dict()
    expected = train(compiled, optimizer, range(2, 4))

    resumed_model = RoutedByBincount()
    resumed_model.load_state_dict(weights)
    resumed, _ = start(resumed_model, "nvfp4_stochastic_rounding")
    resumed.graphquant.load_state_dict(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = train(resumed, torch.optim.SGD(resumed_model.parameters(), lr=0.0), range(2, 3))  # the loss alone is compared
    assert len(resumed.graphquant.plans) == 2
    assert not [w for w in caught if "afresh" in str(w.message)], [str(w.message) for w in caught]
    assert torch.equal(losses, expected[:1])
