"""graphquant inside the tools people train with: activation checkpointing, DDP, FSDP2, amax
reduction over a process group, checkpoints (state_dict) and pickled recipes.

The distributed tests run two CPU processes on gloo (torch.multiprocessing.spawn, a free port, a
time limit); one spawn runs every distributed scenario and saves each rank's results, and the
tests below check them against single-process runs.
"""

import contextlib
import copy
import dataclasses
import functools
import os
import pickle
import warnings
import socket
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint

import graphquant
from graphquant import factories, recipes
from graphquant.formats import fp8, nvfp4
from graphquant.ops.recording import recording

import models
from reference import GemmTape, assert_same_results, forward_backward, fresh_dynamo  # noqa: F401  (fresh_dynamo: autouse)

def x3(batch=2, seq=32, dim=64, seed=7):
    return torch.randn(batch, seq, dim, generator=torch.Generator().manual_seed(seed))


# -- activation checkpointing ------------------------------------------------------------------


class CountingFactory:
    """A factory that records every call (module level, so the recipe still pickles)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = []

    def __call__(self, role):
        self.calls.append(role)
        return self.inner(role)


class CheckpointedPair(torch.nn.Module):
    """first (checkpointed unless mode is None) then second; both models.MLP (fc1, fc2)."""

    def __init__(self, mode=None):
        super().__init__()
        self.first, self.second = models.MLP(), models.MLP()
        self.mode = mode  # None: no checkpoint; False / True: use_reentrant

    def forward(self, x):
        x = self.first(x) if self.mode is None else checkpoint(self.first, x, use_reentrant=self.mode)
        return self.second(x)


SITES = ["first.fc1#0", "first.fc2#0", "second.fc1#0", "second.fc2#0"]


def run_steps(mode, factory, backend, steps=2):
    """(results of the last of ``steps`` forward+backward steps, compiled model, GEMMs run per step)."""
    torch._dynamo.reset()
    model = models.seeded(CheckpointedPair(mode), 0)
    tape = GemmTape() if backend == "tape" else None
    compiled = graphquant.compile(model, graphquant.CustomRecipe(factory), backend=tape.backend if tape else backend)
    gemms = []
    for _ in range(steps):
        if tape:
            tape.clear()
        results = forward_backward(compiled, model, x3())
        gemms.append(len(tape.entries) if tape else None)
    return results, compiled, gemms


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_gemms_are_quantized_with_the_same_gradients(recipe, use_reentrant):
    """Dynamo turns torch.utils.checkpoint (either flavour) into a tag_activation_checkpoint body;
    its GEMMs are sites like any other, the gradients are those of the same model without
    checkpointing (NVFP4: the same stochastic-rounding streams too), the backward recomputes the
    checkpointed forward GEMMs, and the factory is asked once per slot, never by the recompute."""
    inner = {"mxfp8": factories.mxfp8_factory, "nvfp4": factories.nvfp4_factory}[recipe]
    plain_factory, checkpointed_factory = CountingFactory(inner), CountingFactory(inner)
    expected, plain, plain_gemms = run_steps(None, plain_factory, "tape")
    actual, compiled, gemms = run_steps(use_reentrant, checkpointed_factory, "tape")

    assert_same_results(actual, expected, what="checkpointed: ")
    assert [g.site for g in compiled.graphquant.plan.gemms if g.gemm == "fprop"] == SITES
    assert all(g.bucket == "emulated" for g in compiled.graphquant.plan.gemms)
    assert plain_gemms == [12, 12] and all(g > 12 for g in gemms), (plain_gemms, gemms)  # recomputed fprops
    assert len(checkpointed_factory.calls) == len(set(checkpointed_factory.calls)) == 12  # 4 sites x 3 roles
    assert set(checkpointed_factory.calls) == set(plain_factory.calls)


@pytest.mark.slow
def test_checkpointing_with_inductor():
    """Under Inductor too, checkpointing changes no gradient. (The reference is Inductor without
    checkpointing: against aot_eager, Inductor's fused GELU backward can move a value across an
    MXFP8 rounding boundary and part the gradients by one quantization step.)"""
    expected, _, _ = run_steps(None, factories.mxfp8_factory, "inductor", steps=1)
    actual, compiled, _ = run_steps(False, factories.mxfp8_factory, "inductor", steps=1)
    assert_same_results(actual, expected, what="inductor: ")
    assert [g.site for g in compiled.graphquant.plan.gemms if g.gemm == "fprop"] == SITES


def test_delayed_scaling_inside_a_checkpoint_is_refused():
    """The recompute would quantize with the scale the forward already updated (a silent wrong
    gradient); graphquant says so instead."""
    model = CheckpointedPair(False)
    compiled = graphquant.compile(model, recipes.delayed_scaling(), backend="aot_eager")
    with pytest.raises(Exception, match="delayed scaling inside torch.utils.checkpoint"):
        compiled(x3())


def delayed_gradients_factory(role):
    """Current scaling, but delayed scaling for grad_output, which the backward alone quantizes."""
    if factories.is_gradient(role):
        return graphquant.Float8DelayedScalingQuantizer(fp8_dtype="e5m2", amax_history_len=4)
    return graphquant.Float8CurrentScalingQuantizer()


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_delayed_scaling_of_gradients_alone_runs_inside_a_checkpoint(use_reentrant):
    """A gradient's slot (grad_output; attention's do and dp, as the zoo's nvfp4_linear_fp8_dpa
    has them) is quantized in the backward, which the recompute does not run: it was refused as a
    forward slot is. Over three steps the gradients and the delayed state are those of the same
    model without checkpointing."""
    expected, plain, _ = run_steps(None, delayed_gradients_factory, "aot_eager", steps=3)
    actual, compiled, _ = run_steps(use_reentrant, delayed_gradients_factory, "aot_eager", steps=3)
    assert_same_results(actual, expected, what="checkpointed: ")
    state, plain_state = compiled.graphquant.run_state.delayed, plain.graphquant.run_state.delayed
    assert state.keys() == plain_state.keys() and len(state) == 4
    assert all(torch.equal(state[key], plain_state[key]) and state[key][1:].count_nonzero() >= 3 for key in state)  # 3 amaxes recorded


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("recipe", ["delayed_scaling", "nvfp4_block_scaling", "mxfp8_block_scaling", "delayed gradients"])
def test_a_checkpoint_around_a_compiled_module_recomputes_only_stateless_graphs(recipe, use_reentrant):
    """A per-block compile checkpointed from outside: the recompute is a second call of the graph
    in backward, which would move a delayed-scaling slot or the stochastic-rounding step again and
    change the gradients without a word; graphquant refuses it. A stateless recipe recomputes the
    same bits: the gradients are those of the same model without checkpointing; so does delayed
    scaling of grad_output alone, which the backward moves once either way, and NVFP4's stochastic
    rounding of gradients alone under a reentrant checkpoint, whose forward (under no_grad) draws
    nothing: the recompute's draw is the step's one (it was refused as a second)."""
    def step(checkpointed):
        torch._dynamo.reset()
        model = models.seeded(models.MLP(), 0)
        made = graphquant.CustomRecipe(delayed_gradients_factory) if recipe == "delayed gradients" else getattr(recipes, recipe)()
        compiled = graphquant.compile(model, made, backend="aot_eager")
        for _ in range(3):  # the third step quantizes with the scales the first two left
            model.zero_grad()
            x = x3().requires_grad_()
            y = checkpoint(compiled, x, use_reentrant=use_reentrant) if checkpointed else compiled(x)
            y.square().sum().backward()
        return [x.grad, *(p.grad for p in model.parameters()), *compiled.graphquant.run_state.delayed.values()]

    if recipe in ("mxfp8_block_scaling", "delayed gradients") or (recipe == "nvfp4_block_scaling" and use_reentrant):
        assert all(torch.equal(a, b) for a, b in zip(step(True), step(False)))
    else:
        state = "stochastic-rounding step" if recipe == "nvfp4_block_scaling" else "delayed-scaling state"
        with pytest.raises(RuntimeError, match=f"called with grad enabled inside a backward pass, as torch.utils.checkpoint does.* its {state}"):
            step(True)


# -- DDP, FSDP2 and amax reduction in two processes ---------------------------------------------

WORLD = 2
SPAWN_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stack():
    """models.MLPStack at 4 MB of weights: DDP's first bucket is 1 MB, so DDP with 1 MB buckets
    splits it into several."""
    return models.seeded(models.MLPStack(dim=256, hidden=1024), 0)


def stack_input():
    return x3(batch=4, dim=256)


def halves(x):
    return [x[r * (x.shape[0] // WORLD) : (r + 1) * (x.shape[0] // WORLD)] for r in range(WORLD)]


def identity_linear():
    """Linear(64, 64) with the identity as weight: y is exactly the dequantized input (the weight
    quantizes exactly in per-tensor FP8), so y shows which scale the input was quantized with."""
    lin = torch.nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(64))
    return lin


class IdentityExperts(torch.nn.Module):
    """Two experts whose weights are the identity (exact in per-tensor FP8 and in NVFP4): y is
    each group of x dequantized, so it shows the scale each group was quantized with."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.eye(64).repeat(2, 1, 1).to(torch.bfloat16))

    def forward(self, x):
        return torch._grouped_mm(x, self.w, offs=torch.tensor([32, 64], dtype=torch.int32))


class OwnWeight(torch.nn.Module):
    """A weight the module multiplies itself (no nn.Linear)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x):
        return x @ self.weight.T


class OwnWeights(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([OwnWeight(dim), OwnWeight(dim)])

    def forward(self, x):
        return self.layers[1](torch.relu(self.layers[0](x)))


def reducing_current_factory(role):
    return graphquant.Float8CurrentScalingQuantizer(fp8_dtype="e5m2" if factories.is_gradient(role) else "e4m3", with_amax_reduction=True)


def reducing_nvfp4_factory(role):
    """NVFP4 as its recipe sets it (2-D weights; RHT on the columnwise side of input and
    grad_output), with every global amax all-reduced."""
    if factories.is_weight(role):
        return graphquant.NVFP4Quantizer(with_2d_quantization=True, with_amax_reduction=True)
    return graphquant.NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, with_amax_reduction=True)


def distributed_worker(rank, port, out, delayed_recipe):
    """Every distributed scenario on one rank; results go to out/rank<rank>.pt.

    ``delayed_recipe`` reached this process through pickle (spawn pickles its arguments)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    results = {}
    x = halves(stack_input())[rank]

    # DDP: 1 MB buckets, so DDPOptimizer splits the graph and graphquant sees several graphs.
    model = stack()
    ddp = DistributedDataParallel(model, bucket_cap_mb=1)
    compiled = graphquant.compile(ddp, recipes.mxfp8_block_scaling(), backend="aot_eager")
    compiled(x).square().mean().backward()
    results["ddp"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    results["ddp_graphs"] = len(compiled.graphquant.plans)
    results["ddp_sites"] = [g.site for p in compiled.graphquant.plans for g in p.gemms if g.gemm == "fprop"]
    torch._dynamo.reset()  # a model within DDP's first bucket: one graph, traced inside the wrapper
    small = models.seeded(models.MLPStack(dim=256, hidden=256), 0)
    whole = graphquant.compile(DistributedDataParallel(small), recipes.mxfp8_block_scaling(), backend="aot_eager")
    whole(x).square().mean().backward()
    results["ddp_whole_graphs"] = len(whole.graphquant.plans)
    results["ddp_whole_sites"] = [g.site for p in whole.graphquant.plans for g in p.gemms if g.gemm == "fprop"]
    # Stochastic rounding in split graphs: DDPOptimizer runs each compiled piece on fake tensors
    # to compile the next, where the step must not move (nor a real state meet fake tensors).
    torch._dynamo.reset()
    model = stack()
    compiled = graphquant.compile(DistributedDataParallel(model, bucket_cap_mb=1), recipes.nvfp4_block_scaling(), backend="aot_eager")
    compiled(x).square().mean().backward()
    results["ddp_stochastic"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    results["ddp_stochastic_steps"] = (int(compiled.graphquant.state_dict()["rng"][1]), len(compiled.graphquant.plans))

    # FSDP2: every block and the root sharded; the compiled forward sees the unsharded weights.
    torch._dynamo.reset()
    model = stack()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager")
    compiled(x).square().mean().backward()
    results["fsdp"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    # FSDP2 around modules that multiply their own weights: named per module, and the weights the
    # graphs read (the unsharded copies, which the model holds during the forward) are not named
    # as unread after it (when it holds the shards).
    torch._dynamo.reset()
    own = OwnWeights()
    for layer in own.layers:
        fully_shard(layer)
    fully_shard(own)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = graphquant.compile(own, recipes.current_scaling(), backend="aot_eager")
        compiled(x[..., :64]).square().mean().backward()
    results["fsdp_own_sites"] = sorted({g.site for plan in compiled.graphquant.plans for g in plan.gemms})
    results["fsdp_own_warnings"] = [str(w.message) for w in caught if "graphquant" in str(w.message)]
    # The same under DDP with a bucket a weight (4 MB each): its split graphs run on fake tensors.
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = graphquant.compile(DistributedDataParallel(OwnWeights(1024), bucket_cap_mb=1), recipes.current_scaling(), backend="aot_eager")
        compiled(torch.randn(8, 1024)).square().mean().backward()
    results["ddp_own_sites"] = (len(compiled.graphquant.plans), sorted({g.site for plan in compiled.graphquant.plans for g in plan.gemms}))
    results["ddp_own_warnings"] = [str(w.message) for w in caught if "graphquant" in str(w.message)]

    # Current scaling with the amax all-reduced over the recipe's group: rank 1's input is 100x
    # rank 0's. Eagerly (graphquant.ops.recording sees the scales), then aot_eager and Inductor.
    x_amax = torch.randn(64, 64, generator=torch.Generator().manual_seed(10 + rank)) * (1 + 99 * rank)
    results["x_amax"] = x_amax
    for group in (dist.group.WORLD, None):
        recipe = graphquant.CustomRecipe(reducing_current_factory, amax_reduction_group=group)
        tag = "reduced" if group is not None else "local"
        torch._dynamo.reset()
        scales = []
        with recording(lambda gemm: scales.append(gemm.a_operand.tensors[1].clone())), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graphquant.compile(identity_linear(), recipe, backend=graphquant.explainer.run_eagerly)(x_amax)
        results[f"eager_scale_{tag}"] = scales[0]
        results[f"warnings_{tag}"] = [str(w.message) for w in caught if "amax_reduction_group" in str(w.message)]
        for backend in ("aot_eager", "inductor") if group is not None else ("aot_eager",):
            torch._dynamo.reset()
            results[f"{backend}_{tag}"] = graphquant.compile(identity_linear(), recipe, backend=backend)(x_amax).detach()

    # A group named while no quantizer asks to reduce: per-tensor scaling says so, MXFP8 (local blocks) does not.
    for tag, recipe in (("unasked", recipes.current_scaling()), ("blocks", recipes.mxfp8_block_scaling())):
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graphquant.compile(identity_linear(), dataclasses.replace(recipe, amax_reduction_group=dist.group.WORLD), backend="aot_eager")(x_amax)
        results[f"warnings_{tag}"] = [str(w.message) for w in caught if "amax_reduction_group" in str(w.message)]

    # NVFP4 with its global amaxes all-reduced over the recipe's group (the same inputs): a training
    # step eagerly, where graphquant.ops.recording sees each GEMM operand's amax, then in aot_eager and
    # Inductor graphs.
    nvfp4_recipe = graphquant.CustomRecipe(reducing_nvfp4_factory, amax_reduction_group=dist.group.WORLD)
    amaxes = {}
    record = lambda gemm: amaxes.update({gemm.gemm: (gemm.a_operand.tensors[2].clone(), gemm.b_operand.tensors[2].clone())})  # noqa: E731
    for name, backend in (("eager", graphquant.explainer.run_eagerly), ("aot_eager", "aot_eager"), ("inductor", "inductor")):
        torch._dynamo.reset()
        x = x_amax.clone().requires_grad_()
        with recording(record) if name == "eager" else contextlib.nullcontext():
            y = graphquant.compile(identity_linear(), nvfp4_recipe, backend=backend)(x)
            y.square().sum().backward()
        results[f"nvfp4_{name}"] = (y.detach(), x.grad)
    results["nvfp4_amaxes"] = amaxes
    # A weight that differs between ranks (rank 1's is 100x rank 0's): inference must encode it with
    # the all-reduced amax as training does.
    for mode in ("training", "inference"):
        torch._dynamo.reset()
        linear = identity_linear()
        with torch.no_grad():
            linear.weight.mul_(1 + 99 * rank)
        results[f"nvfp4_{mode}_weight"] = graphquant.compile(linear, nvfp4_recipe, backend="aot_eager", mode=mode)(x_amax).detach()

    # Grouped experts: each group's amax all-reduced on its own (group 1's rows are 10x group 0's on
    # both ranks, rank 1's 100x rank 0's), current scaling and NVFP4; a backward runs the reducing
    # grad_output quantize and the weights' columnwise (whose amaxes are then not handed over).
    x_grouped = (x_amax * torch.cat([torch.ones(32, 1), torch.full((32, 1), 10.0)])).to(torch.bfloat16)
    results["x_grouped"] = x_grouped
    for tag, factory, group in (("current", reducing_current_factory, dist.group.WORLD), ("local", reducing_current_factory, None),
                                ("nvfp4", reducing_nvfp4_factory, dist.group.WORLD)):
        recipe = graphquant.CustomRecipe(factory, amax_reduction_group=group)
        for backend in ("aot_eager", "inductor") if tag == "current" else ("aot_eager",):
            torch._dynamo.reset()
            x = x_grouped.clone().requires_grad_()
            experts = IdentityExperts()
            y = graphquant.compile(experts, recipe, backend=backend)(x)
            y.float().square().sum().backward()
            results[f"grouped_{tag}_{backend}"] = (y.detach(), x.grad, experts.w.grad)

    # Delayed scaling: after two steps each slot's scale and amax history, with and without a group.
    for group in (dist.group.WORLD, None):
        torch._dynamo.reset()
        recipe = dataclasses.replace(delayed_recipe, amax_reduction_group=group)
        model = models.seeded(models.MLP(), 0)
        compiled = graphquant.compile(model, recipe, backend="aot_eager")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                compiled(x3(seed=rank) * (1 + 9 * rank)).square().mean().backward()
        tag = "reduced" if group is not None else "local"
        results[f"delayed_{tag}"] = {str(role): state.clone() for role, state in compiled.graphquant.run_state.delayed.items()}
        results[f"delayed_warnings_{tag}"] = [str(w.message) for w in caught if "amax_reduction_group" in str(w.message)]

    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def distributed():
    """The results of both ranks (spawned once for the module)."""
    out = tempfile.mkdtemp(prefix="graphquant_dist_")
    recipe = recipes.delayed_scaling(amax_history_len=4)
    context = mp.spawn(distributed_worker, args=(free_port(), out, recipe), nprocs=WORLD, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the two-process run did not finish within {SPAWN_TIMEOUT_S} s")
    return [torch.load(os.path.join(out, f"rank{rank}.pt")) for rank in range(WORLD)]


def single_process_grads():
    """The gradients DDP and FSDP2 must give: the mean of both ranks' losses in one process."""
    torch._dynamo.reset()
    model = stack()
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager")
    loss = sum(compiled(h).square().mean() for h in halves(stack_input())) / WORLD
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_ddp_and_fsdp2_gradients_equal_a_single_process_run(distributed, kind):
    expected = single_process_grads()
    for rank, results in enumerate(distributed):
        assert_same_results(results[kind], expected, what=f"{kind} rank {rank}: ")


@pytest.mark.slow
def test_fsdp2_and_split_ddp_name_what_modules_multiply_by_their_own_weights(distributed):
    """Under FSDP2 and DDP's split graphs, a module's own weight is named per module, and the
    first call names none as read by no graph (they read the unsharded copies, or fake tensors)."""
    results = distributed[0]
    assert results["fsdp_own_sites"] == ["layers.0.linear.0#0", "layers.1.linear.0#0"]
    assert results["fsdp_own_warnings"] == [] and results["ddp_own_warnings"] == []
    graphs, sites = results["ddp_own_sites"]
    assert graphs > 1 and sites == ["layers.0.linear.0#0", "layers.1.linear.0#0"]


@pytest.mark.slow
def test_ddp_split_graphs_keep_their_sites(distributed):
    """DDPOptimizer compiled several graphs; together they hold every GEMM once, under the
    wrapped model's names (Dynamo traces DDP's inner module), as one unsplit graph does, so one
    recipe serves both."""
    results = distributed[0]
    assert results["ddp_graphs"] > 1 and results["ddp_whole_graphs"] == 1
    names = sorted(f"layers.{i}.mlp.fc{j}#0" for i in range(2) for j in (1, 2))
    assert sorted(results["ddp_sites"]) == names and sorted(results["ddp_whole_sites"]) == names


@pytest.mark.slow
def test_stochastic_rounding_runs_in_ddp_split_graphs(distributed):
    """Each split graph moves the step once (as a graph break's graphs do), and both ranks end
    with the same all-reduced gradients."""
    steps, graphs = distributed[0]["ddp_stochastic_steps"]
    assert graphs > 1 and steps == graphs
    assert_same_results(distributed[1]["ddp_stochastic"], distributed[0]["ddp_stochastic"], what="rank 1 against rank 0: ")


def expected_identity_output(x, amax):
    """What identity_linear gives for x quantized to E4M3 with the scale of ``amax``."""
    scale, scale_inv = fp8.scales(amax, "e4m3", 0.0, False)
    return fp8.cast_to_fp8(x.float() * scale, "e4m3").float() * scale_inv


@pytest.mark.slow
def test_a_recipe_asking_to_reduce_amaxes_without_a_group_warns_in_a_run_of_several_processes(distributed):
    for results in distributed:
        assert results["warnings_reduced"] == []
        [message] = results["warnings_local"]
        assert "ask to all-reduce their amaxes" in message and "names no amax_reduction_group" in message


@pytest.mark.slow
def test_a_group_no_quantizer_reduces_over_warns_in_a_run_of_several_processes(distributed):
    """A recipe naming an amax_reduction_group whose per-tensor quantizers do not ask to reduce
    (current scaling's with_amax_reduction defaults to False, as TE's) reduces nothing: said, with
    what to ask for; a recipe of block formats, which need no reduction, is left alone."""
    for results in distributed:
        [message] = results["warnings_unasked"]
        assert "names an amax_reduction_group" in message and "with_amax_reduction=True" in message
        assert results["warnings_blocks"] == []


@pytest.mark.slow
def test_current_scaling_reduces_the_amax_over_the_recipes_group(distributed):
    """With_amax_reduction and a group: both ranks quantize with the scale of the larger amax,
    eagerly, in aot_eager graphs and in Inductor graphs. Without a group each keeps its own."""
    global_amax = torch.stack([r["x_amax"].abs().amax() for r in distributed]).amax()
    eager_scales = [r["eager_scale_reduced"] for r in distributed]
    assert torch.equal(eager_scales[0], eager_scales[1])
    assert torch.equal(eager_scales[0].reshape(()), fp8.scales(global_amax, "e4m3", 0.0, False)[1])
    local_scales = [r["eager_scale_local"] for r in distributed]
    assert not torch.equal(local_scales[0], local_scales[1])
    for rank, results in enumerate(distributed):
        x = results["x_amax"]
        reduced = expected_identity_output(x, global_amax)
        local = expected_identity_output(x, x.abs().amax())
        tolerance = dict(rtol=1e-6, atol=1e-6 * x.abs().max().item())
        for backend in ("aot_eager", "inductor"):
            torch.testing.assert_close(results[f"{backend}_reduced"], reduced, **tolerance, msg=f"rank {rank} {backend}")
        torch.testing.assert_close(results["aot_eager_local"], local, **tolerance)
    assert not torch.allclose(distributed[0]["aot_eager_reduced"], distributed[0]["aot_eager_local"])


@pytest.mark.slow
def test_nvfp4_reduces_its_global_amaxes_over_the_recipes_group(distributed):
    """NVFP4 with_amax_reduction and a group: in each GEMM of a training step both ranks encode each
    operand with one global amax, the larger of theirs (fprop's input: max |x| over both ranks;
    wgrad's, columnwise: max |H x^T| over both, after the Hadamard transform); aot_eager and
    Inductor graphs quantize with it too."""
    xs = [r["x_amax"] for r in distributed]
    amaxes = [r["nvfp4_amaxes"] for r in distributed]
    assert amaxes[0].keys() == {"fprop", "dgrad", "wgrad"}
    for gemm, operands in amaxes[0].items():
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(operands, amaxes[1][gemm])), gemm
    global_amax = torch.stack([x.abs().amax() for x in xs]).amax()
    assert torch.equal(amaxes[0]["fprop"][0], global_amax)
    after_rht = [nvfp4.hadamard_transform(x.t(), random_sign_mask=True).abs().amax() for x in xs]
    assert torch.equal(amaxes[0]["wgrad"][1], torch.stack(after_rht).amax())
    for rank, results in enumerate(distributed):
        x = results["x_amax"]
        # identity_linear's weight is exact in NVFP4 too, so y shows the input's quantization.
        expected_y = nvfp4.dequantize(*nvfp4.quantize(x, tile_rows=1, row_scaled=False, rng=None, amax=global_amax))
        _, eager_dx = results["nvfp4_eager"]
        for backend in ("eager", "aot_eager", "inductor"):
            y, dx = results[f"nvfp4_{backend}"]
            torch.testing.assert_close(y, expected_y, rtol=1e-6, atol=0, msg=f"rank {rank} {backend}")
            torch.testing.assert_close(dx, eager_dx, rtol=1e-6, atol=1e-6 * eager_dx.abs().max().item(), msg=f"rank {rank} {backend}")


@pytest.mark.slow
def test_grouped_experts_reduce_each_groups_amax_over_the_recipes_group(distributed):
    """torch._grouped_mm with reducing formats: each expert's rows are quantized with the larger of
    the ranks' amaxes of that expert's rows (not of the whole tensor), in aot_eager and Inductor
    graphs; NVFP4's global amax per expert too; the backward's gradients are the same on both
    ranks' graphs of each backend. Without a group each rank keeps its own amaxes."""
    xs = [r["x_grouped"] for r in distributed]
    rows = (slice(0, 32), slice(32, 64))
    group_amaxes = [torch.stack([x[r].float().abs().amax() for x in xs]).amax() for r in rows]
    for rank, results in enumerate(distributed):
        x = xs[rank].float()
        reduced = torch.cat([expected_identity_output(x[r], amax) for r, amax in zip(rows, group_amaxes)]).to(torch.bfloat16)
        local = torch.cat([expected_identity_output(x[r], x[r].abs().amax()) for r in rows]).to(torch.bfloat16)
        # The GEMM applies x's and w's scales as one fp32 factor, not exactly 1/scale: where the
        # dequantized value is a bf16 tie (amax 3472 gives 88 * 7.75 = 682) the product may round
        # to the other side, one bf16 step (2^-8 to 2^-7 of the value), where another scale moves
        # values by up to an E4M3 step (2^-4 to 2^-3).
        close = dict(rtol=2**-7, atol=0)
        for backend in ("aot_eager", "inductor"):
            torch.testing.assert_close(results[f"grouped_current_{backend}"][0], reduced, **close)
        torch.testing.assert_close(results["grouped_local_aot_eager"][0], local, **close)
        grads = {backend: dict(zip(("dx", "dw"), results[f"grouped_current_{backend}"][1:])) for backend in ("aot_eager", "inductor")}
        assert_same_results(grads["inductor"], grads["aot_eager"], what=f"rank {rank}: ")
        nvfp4_y = torch.cat([
            nvfp4.dequantize(*nvfp4.quantize(x[r], tile_rows=1, row_scaled=False, rng=None, amax=amax)) for r, amax in zip(rows, group_amaxes)
        ]).to(torch.bfloat16)
        torch.testing.assert_close(results["grouped_nvfp4_aot_eager"][0], nvfp4_y, **close)
    assert not torch.allclose(distributed[0]["grouped_current_aot_eager"][0], distributed[0]["grouped_local_aot_eager"][0], **close)


@pytest.mark.slow
def test_nvfp4_inference_reduces_the_weight_amax_as_training_does(distributed):
    """Inference does not keep a reducing weight's quantized copy outside the graph: made there, its
    amax would be this rank's alone (rank 0's identity weight quantizes to exact ones, not to the
    coarser values of the larger amax that training encodes it with)."""
    for rank, results in enumerate(distributed):
        assert torch.equal(results["nvfp4_inference_weight"], results["nvfp4_training_weight"]), f"rank {rank}"


@pytest.mark.slow
def test_delayed_scaling_reduces_the_amax_over_the_recipes_group(distributed):
    """Delayed scaling (reduce_amax, the default): after two steps on different data the ranks
    hold the same scale and amax history in every slot; without a group they differ, which the
    first call says (it said nothing: only current scaling's with_amax_reduction counted as asking)."""
    reduced = [r["delayed_reduced"] for r in distributed]
    local = [r["delayed_local"] for r in distributed]
    assert reduced[0].keys() == reduced[1].keys() and len(reduced[0]) == 6
    assert all(torch.equal(reduced[0][k], reduced[1][k]) for k in reduced[0])
    assert all(reduced[0][k][1:].amax() > 0 for k in reduced[0])  # amaxes were recorded
    assert not all(torch.equal(local[0][k], local[1][k]) for k in local[0])
    for results in distributed:
        assert results["delayed_warnings_reduced"] == []
        [message] = results["delayed_warnings_local"]
        assert "ask to all-reduce their amaxes" in message


# -- checkpoints and pickling ------------------------------------------------------------------


def test_state_dict_round_trip_and_load_without_graphquant(tmp_path):
    """A compiled model's state_dict holds the high-precision parameters only (graphquant adds
    nothing to it); saved and loaded, it gives a plain model the eager outputs and a freshly
    compiled one the compiled outputs."""
    model = models.seeded(models.MLPStack(), 0)
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled(x3()).square().mean().backward()
    optimizer.step()

    state = compiled.state_dict()
    plain_keys = set(models.MLPStack().state_dict())
    assert set(state) == {f"_orig_mod.{k}" for k in plain_keys}  # torch.compile's wrapper prefix, nothing more
    assert set(model.state_dict()) == plain_keys
    assert all(v.dtype == torch.float32 for v in state.values())
    torch.save(model.state_dict(), tmp_path / "model.pt")

    plain = models.MLPStack()
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    x = x3(seed=9)
    with torch.no_grad():
        assert torch.equal(plain(x), model(x))

    fresh = models.MLPStack()
    fresh_compiled = graphquant.compile(fresh, recipes.mxfp8_block_scaling(), backend="aot_eager")
    fresh_compiled.load_state_dict(state)
    assert torch.equal(fresh_compiled(x), compiled(x))
    assert not torch.allclose(compiled(x), plain(x))  # the compiled model really quantizes


def test_inference_follows_load_state_dict():
    """Inference quantizes the weights as they are at each call, so the call after a
    load_state_dict uses the loaded weights."""
    model = models.seeded(models.MLPStack(), 0)
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager", mode="inference")
    x = x3()
    with torch.no_grad():
        before = compiled(x)
        other = models.seeded(models.MLPStack(), 1)
        compiled.load_state_dict({f"_orig_mod.{k}": v for k, v in other.state_dict().items()})
        after = compiled(x)
        torch._dynamo.reset()
        expected = graphquant.compile(other, recipes.mxfp8_block_scaling(), backend="aot_eager", mode="inference")(x)
    assert torch.equal(after, expected)
    assert not torch.equal(before, after)


def local_factory_recipe():
    def factory(role):
        return graphquant.IdentityQuantizer()

    return graphquant.CustomRecipe(factory)


def test_recipes_pickle_and_lambdas_say_why_not():
    """Recipes from module-level factories (presets, zoo, partials, a callable instance) pickle
    and plan the same; the process group is dropped; a lambda or local factory raises an error
    that says what to do."""
    import torch.distributed as dist

    candidates = [
        recipes.delayed_scaling(margin=1),
        graphquant.zoo.recipe("mxfp8_fwd_nvfp4_bwd"),
        graphquant.CustomRecipe(functools.partial(factories.delayed_scaling_factory, amax_history_len=16)),
        graphquant.CustomRecipe(CountingFactory(factories.mxfp8_factory), expected_names=("fc1",)),
    ]
    role = graphquant.QuantizerRole("linear", "grad_output", "fc1")
    for recipe in candidates:
        again = pickle.loads(pickle.dumps(recipe))
        assert again.qfactory(role) == recipe.qfactory(role)
        assert again.expected_names == recipe.expected_names
    grouped = dataclasses.replace(recipes.current_scaling(), amax_reduction_group=dist.group.WORLD)
    assert pickle.loads(pickle.dumps(grouped)).amax_reduction_group is None
    for bad in (graphquant.CustomRecipe(lambda role: graphquant.IdentityQuantizer()), local_factory_recipe()):
        with pytest.raises(pickle.PicklingError, match="define the factory at module level"):
            pickle.dumps(bad)


def test_recipes_are_values_that_equal_their_copies_and_pickles():
    """Presets whose factories are functools.partials (delayed scaling, a zoo recipe with FP8
    attention) compared by the partial's identity: two calls of one preset, a pickle round trip
    and a deep copy were all unequal, which code that rebuilds when the recipe changes is misled by."""
    for make in (recipes.delayed_scaling, lambda: graphquant.zoo.with_fp8_attention(recipes.mxfp8_block_scaling())):
        recipe = make()
        for same in (make(), pickle.loads(pickle.dumps(recipe)), copy.deepcopy(recipe)):
            assert same == recipe and hash(same) == hash(recipe)
    assert recipes.delayed_scaling(margin=1) != recipes.delayed_scaling()
    assert recipes.delayed_scaling() != dataclasses.replace(recipes.delayed_scaling(), fp8_dpa=True)


def test_a_copied_recipe_keeps_its_process_group():
    """Pickling drops a process group (it does not pickle; spawned workers give theirs by name), but
    copy.copy and copy.deepcopy in the same process went through pickle's state too: a config
    system's deep copy of a recipe then reduced no amax, and only a run of several processes warned."""
    group = object()  # a ProcessGroup stands here: only its identity matters to a copy
    recipe = dataclasses.replace(recipes.current_scaling(), amax_reduction_group=group, expected_names=("fc1",))
    for copied in (copy.copy(recipe), copy.deepcopy(recipe)):
        assert copied.amax_reduction_group is group and copied == recipe
    plain = recipes.current_scaling()  # no group: every other field still copied
    assert copy.deepcopy(plain) == plain and copy.deepcopy(plain).amax_reduction_group is None


def test_a_graphquant_model_refuses_pickling_saying_what_a_checkpoint_saves():
    """torch.save(model), pickle and copy.copy of a graphquant model (or of a module holding it)
    fail with a message naming the checkpoint's parts, not Python's "can't pickle local object";
    copy.deepcopy still gives a model of its own."""
    import copy
    import io

    compiled = graphquant.compile(torch.nn.Sequential(torch.nn.Linear(64, 64)), recipes.mxfp8_block_scaling(), backend="aot_eager")
    compiled(torch.randn(32, 64))
    for attempt in (lambda: torch.save(compiled, io.BytesIO()), lambda: pickle.dumps(compiled), lambda: copy.copy(compiled),
                    lambda: torch.save(torch.nn.ModuleDict({"model": compiled}), io.BytesIO())):
        with pytest.raises(TypeError, match=r"does not pickle or shallow-copy .*compiled\.graphquant\.state_dict\(\)"):
            attempt()
    assert copy.deepcopy(compiled).graphquant is not compiled.graphquant


def test_a_model_whose_frames_dynamo_skips_is_said_to_run_eagerly_saying_why():
    """A per-expert loop over the token indices torch.where finds breaks the graph inside a loop,
    where Dynamo skips the whole frame: no graph, the model eager and unquantized. The warning gave
    the reason of a DistributedDataParallel around a torch.nn container, which this is not."""

    class LoopedExperts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(64, 4)
            self.experts = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))

        def forward(self, x):
            choice, out = self.router(x).argmax(-1), torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                (tokens,) = torch.where(choice == e)
                out = out.index_add(0, tokens, expert(x[tokens]))
            return out

    model, tokens = models.seeded(LoopedExperts()), torch.randn(32, 64)
    compiled = graphquant.compile(model, recipes.current_scaling(), backend="aot_eager")
    with pytest.warns(UserWarning, match=r"no graph in this model's first call.*Dynamo skipped the model's frames.*loop") as warned:
        y = compiled(tokens)
    assert not any("torch.nn container" in str(w.message) for w in warned)
    assert torch.equal(y, model(tokens))


def test_graphquant_around_ddp_of_a_torch_nn_container_says_it_compiled_no_graph():
    """Dynamo compiles no frame of torch.nn's own code by itself: graphquant.compile of a
    DistributedDataParallel around an nn.Sequential ran the model eagerly, unquantized, with no
    word, and its plan said to run the model once (one process of gloo here)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        sequential = models.seeded(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)))
        model = graphquant.compile(torch.nn.parallel.DistributedDataParallel(sequential), recipes.mxfp8_block_scaling(), backend="aot_eager")
        x = x3()
        with pytest.warns(UserWarning, match=r"^graphquant: torch.compile gave graphquant no graph in this model's first call") as warned:
            y = model(x)
            y.sum().backward()
        assert len([w for w in warned if "graphquant" in str(w.message)]) == 1
        assert torch.equal(y, sequential(x))
        with pytest.raises(RuntimeError, match="gave graphquant no graph: the model ran eagerly"):
            model.graphquant.plan
    finally:
        dist.destroy_process_group()
