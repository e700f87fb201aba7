"""graphquant.compile: torch.compile with graphquant's passes in front of the real backend."""

from __future__ import annotations

import collections
import contextvars
import copy
import dataclasses
import functools
import inspect
import os
import re
import threading
import types
import weakref
from typing import Any, Callable, Mapping, NamedTuple, NoReturn, Optional, Sequence, Union

import torch
from torch import fx
from torch._dynamo.exc import exceptions_allowed_to_be_fallback
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from graphquant.passes.attention_spelling import fold_attention
from graphquant.passes.linear_spelling import fold_linears
from graphquant.passes.expert_weights import ExpertWeight, FrozenStack, UnfreezableStack, expert_weights, mark_frozen_stacks
from graphquant.passes.find_attention import find_attention, leave_attention_in_high_precision
from graphquant.passes import matrix_products
from graphquant.passes.opaque_calls import mark_opaque_products
from graphquant.passes.positional_operands import make_operands_positional
from graphquant.passes.find_gemms import (
    GROUPED, LINEAR, UNQUANTIZED_LINEAR, Frame, find_gemms, fqn_from_stack_path, nodes_and_bodies, owner_of, parameter_path, root_local,
    VIEWS_AND_CASTS, number_module_calls, site_weight, target_name, without_compile_wrappers, written_at,
)
from graphquant.passes.gemms_sharing_x import merge_gemms_sharing_x
from graphquant import distributed, user_stack
from graphquant.eager_products import eager_products, next_node_number
from graphquant.model_methods import watch_methods
from graphquant.ops.functional import MixedDtypesError
from graphquant.passes.rewrite import moved_by_a_recompute, rewrite
from graphquant.passes.plan import Plan, PlanError, Planner
from graphquant.recipes import CustomRecipe
from graphquant.quantizers import Quantizer
from graphquant.roles import QuantizerRole
from graphquant.run_state import RunState

MODES = (None, "training", "inference")

# Every graphquant.compile brings its own backend, and Dynamo counts each against the recompile
# limit that all compiles of one forward share; past it the model would run eagerly, unquantized
# (_failing_past_the_recompile_limit makes that an error). Isolated compiles (torch >= 2.13) each
# keep their own count; before, models compiled from different modules keep theirs through the
# guard on each graph's module (_guard_identity).
_ISOLATED = {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}


class _PlanOrigin(NamedTuple):
    """Where a plan came from: whether its graph trains, the number of the forward call that
    compiled it, the code Dynamo traced it from, and each module's largest call number among its
    sites (the offsets a later graph of that call counts on from: GraphquantBackend._counting_on)."""

    training: bool
    call: int
    code: Optional[types.CodeType]
    largest_calls: dict[str, int]


class GraphquantBackend:
    """A torch.compile backend: find GEMMs, plan, rewrite, then hand the graph to ``inner``.

    It owns what outlives one graph: the planner (so the factory is asked once per slot across
    recompiles) and the slots' state (``run_state``: delayed scaling's, the stochastic-rounding
    step), which ``state_dict`` / ``load_state_dict`` carry across a checkpoint.
    """

    def __init__(
        self,
        recipe: CustomRecipe,
        *,
        inner: Union[str, Callable] = "inductor",
        strict: bool = False,
        mode: Optional[str] = None,
        seed: int = 0,
        dump_dir: Optional[str] = None,
        inductor_options: Optional[dict] = None,
        root: Optional[torch.nn.Module] = None,
    ) -> None:
        if mode not in MODES:
            compile_modes = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
            hint = f"; torch.compile's mode is graphquant.compile's compile_mode={mode!r}" if mode in compile_modes else ""
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}{hint}")
        self.planner = Planner(recipe, strict=strict)
        self.inner = inner
        self.mode = mode
        self.dump_dir = dump_dir
        self.inductor_options = inductor_options or {}
        self.root = root
        self.plans: list[Plan] = []
        self.plan_origins: list[_PlanOrigin] = []  # each of ``plans``'
        # Frame.offsets as each code was first compiled for its modules (_counting_on), by code and Frame.modules.
        self.call_offsets: dict[tuple[types.CodeType, tuple], tuple[tuple[str, int], ...]] = {}
        self.training_call = False  # whether the latest call runs training graphs (the forward's entry sets it)
        self.calls = 0  # the calls so far (the forward's entry counts them)
        # The refusals of the graphs that only raise them (a size that tiles no block): each takes one
        # of Dynamo's recompiles of the code, which the recompile limit's error then names.
        self.refusals: list[str] = []
        self.run_state = RunState(seed)  # the slots' state from call to call, and what a checkpoint keeps of it
        self.first_call_checked = False  # check_the_first_compile ran (after a forward's or a generate's first call)
        self.first_compile = threading.RLock()  # held by the calls until the first has compiled (_checking_the_first_compile)
        # Parameters some graph reads other than as its linear's weight, each with the sites that multiply it.
        self.weights_read_otherwise: dict[str, set[str]] = {}
        self.unquantized_linears: set[str] = set()  # nn.Linear modules whose own product is no site (the plan says why)
        # check_eager_products ran at a call with grad enabled, or has nothing to find: an inference
        # model's calls make no autograd graph, and a backend that runs graphs as they are leaves their products in it.
        self.eager_products_checked = mode == "inference" or not _graphs_are_one_autograd_node(inner)
        self.read_parameters: set[str] = set()  # the names of the model's parameters some compiled graph reads
        # How the graphs so far read each expert stack, or why it cannot be frozen (graphquant.freeze).
        self.expert_weights: dict[str, Union[ExpertWeight, UnfreezableStack]] = {}
        # graphquant's compile of each module forward a generate runs through (compile sets it for a
        # model that generates): what a call of the model runs where a generate has put a forward in.
        self.module_forwards: dict[torch.nn.Module, Callable] = {}

    @property
    def plan(self) -> Plan:
        """The plan of the graphs that the latest call to compile graphs for calls such as the
        latest one (training or not) compiled, combined in graph order: a graph break's graphs
        together (a model's and its loss's, whose plan alone would list no GEMM), a recompile's
        graphs alone; a training call after an evaluation under no_grad runs the training graphs
        compiled before it (``plans`` has every graph's)."""
        if not self.plans and self.first_call_checked:
            raise RuntimeError("torch.compile gave graphquant no graph: the model ran eagerly, unquantized (its first call warned why)")
        if not self.plans:
            raise RuntimeError("nothing compiled yet: run the model once (or use graphquant.explain)")
        alike = [(plan, origin.call) for plan, origin in zip(self.plans, self.plan_origins) if origin.training == self.training_call]
        alike = alike or [(plan, origin.call) for plan, origin in zip(self.plans, self.plan_origins)]
        latest = [plan for plan, call in alike if call == alike[-1][1]]
        return latest[0] if len(latest) == 1 else Plan.combine(latest)

    def check_the_first_compile(self) -> None:
        """Once the model's first call has compiled its graphs, say whether they hold no GEMM at all
        (one graph of a graph break's may well hold none), which of the recipe's expected names and
        loaded state entries none of them takes, and which of the model's nn.Linear modules and
        parameters no graph holds: torch.compile may have run the code that calls them eagerly, in
        high precision."""
        if self.first_call_checked:
            return
        self.first_call_checked = True
        if not self.plans:
            self.eager_products_checked = True  # every product ran eagerly: nothing more to tell
            inner = self.root.module if isinstance(self.root, torch.nn.parallel.DistributedDataParallel) else self.root
            if inner is not None and type(inner).forward.__module__.startswith("torch.nn"):  # nn.Sequential's own, or a subclass's
                why = (
                    "Dynamo compiles no frame of torch.nn's own code by itself, and a DistributedDataParallel (or another "
                    "torch.nn wrapper) of a torch.nn container such as Sequential leaves it none; graphquant.compile the module "
                    "and wrap that (DistributedDataParallel(graphquant.compile(model, recipe))), or give the container a "
                    "forward of your own"
                )
            else:
                why = (
                    "Dynamo skipped the model's frames, as it does a frame whose graph break it cannot take (one inside a loop, "
                    "such as a per-expert loop over token indices that torch.where finds); TORCH_LOGS=graph_breaks says where. "
                    "Write that code without the break: experts as one torch._grouped_mm over the tokens sorted by expert, as "
                    "transformers' grouped_mm experts are"
                )
            user_stack.warn(
                f"graphquant: torch.compile gave graphquant no graph in this model's first call, so it ran the model's code "
                f"eagerly, unquantized: {why}"
            )
            return
        if not any(plan.gemms for plan in self.plans):
            # A product it found but does not quantize says why (graphquant.explain lists them all).
            skipped = [f"{what} ({why})" for plan in self.plans for what, why in plan.skipped]
            listed = "; ".join(skipped[:3]) + (f"; and {len(skipped) - 3} more" if len(skipped) > 3 else "")
            user_stack.warn(
                f"graphquant found no GEMM {'it quantizes ' if skipped else ''}in the graphs of this model's first call; it runs unchanged"
                + (f". Not quantized: {listed}" if skipped else "")
            )
        self.planner.warn_of_unmatched_names(Plan.combine(self.plans))
        self.run_state.warn_of_unclaimed(self.plans, any(origin.training for origin in self.plan_origins))
        self._warn_of_unreduced_amaxes()
        if self.root is not None:
            self._warn_of_unplanned_linears()
            self._warn_of_unread_parameters()

    def check_eager_products(self, outputs: Any, since: int) -> None:
        """After the first compile, at the first call with grad enabled (an evaluation under
        no_grad may come first), say how many matrix products it ran outside the compiled graphs
        (graphquant.eager_products: its autograd nodes from ``since`` on), which no check of
        modules or parameters sees in a module of none (attention under torch.compiler.disable)."""
        self.eager_products_checked = True
        eager = eager_products(outputs, since, attention=self.planner.recipe.fp8_dpa)
        if eager:
            user_stack.warn(
                f"graphquant: this training call ran {matrix_products.described(eager)} outside the compiled graphs, in "
                "high precision: torch.compile ran the code computing them eagerly (under torch.compiler.disable, or past "
                "a graph break it could not take; TORCH_LOGS=graph_breaks says where)"
            )

    def _warn_of_unplanned_linears(self) -> None:
        """Say which of the model's nn.Linear modules no graph holds: a module whose weight the
        model's code multiplies itself, by the sites that do; any other, as not compiled."""
        planned = {g.site.rpartition("#")[0] for plan in self.plans for g in plan.gemms} | self.unquantized_linears
        # An nn.MultiheadAttention's out_proj runs inside its one call, which the plan lists as not quantized.
        named = [(without_compile_wrappers(name), m) for name, m in _outside_nested_models(self.root)]  # as sites name them
        inside_attention = {f"{name}.out_proj" for name, m in named if isinstance(m, torch.nn.MultiheadAttention)}
        linears = [name for name, m in named if isinstance(m, torch.nn.Linear) and name not in inside_attention]
        unplanned = [name for name in linears if name not in planned]
        read = {name: self.weights_read_otherwise[f"{name}.weight"] for name in unplanned if f"{name}.weight" in self.weights_read_otherwise}
        if read:
            user_stack.warn(
                "graphquant: the model's code reads these nn.Linear modules' weights itself, without calling them: "
                + "; ".join(f"{name} ({'multiplied in ' + ', '.join(sorted(sites)) if sites else 'read by other ops, or multiplied after them'})" for name, sites in read.items())
                + ". Their products are planned by the names of the sites that multiply them (the modules whose code does), "
                "so a recipe's rule for the linear's own name does not reach them; call the module (self.lm_head(x), not "
                "F.linear(x, self.lm_head.weight)) to plan it by its name"
            )
        unplanned = [name for name in unplanned if name not in read]
        if unplanned:
            user_stack.warn(
                f"graphquant: {len(unplanned)} of the model's {len(linears)} nn.Linear modules are in no compiled graph "
                f"({', '.join(unplanned[:4])}{', ...' if len(unplanned) > 4 else ''}): they did not run, or torch.compile "
                "ran the code that calls them eagerly, in high precision (a graph break it could not take, as inside a "
                "checkpointed block; TORCH_LOGS=graph_breaks says where, and for transformers' gradient checkpointing "
                "torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True lets it compile)"
            )

    def _note_read_parameters(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        """Note the names of the model's parameters a graph reads, as the model holds them now
        (FSDP2 holds its unsharded copies during the forward, the shards after): its inputs, or
        where they are fake tensors (DDP's split graphs), what their sources name in the frame."""
        if self.root is None:
            return
        sources = [node.meta["grapharg"].source for node in gm.graph.find_nodes(op="placeholder") if node.meta.get("grapharg") is not None]
        lifted = {id(t) for t in (*example_inputs, *map(_frame_value, map(_source_name, sources))) if isinstance(t, torch.nn.Parameter)}
        self.read_parameters.update(name for name, p in self.root.named_parameters(remove_duplicate=False) if id(p) in lifted)

    def _note_weights_read_otherwise(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        """Note each weight a graph reads other than as its own module's linear site (an
        nn.MultiheadAttention's out_proj, whose weight its one call reads; a model's product of a
        module's weight): graphquant.freeze keeps such a linear, whose weight that code reads. A
        linear whose weight a call the plan lists as not quantized reads (nn.TransformerEncoderLayer's
        fast path) is one of ``unquantized_linears``: the plan says why."""
        if self.root is None:
            return
        names = {id(p): name for name, p in self.root.named_parameters(remove_duplicate=False)}
        for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
            name = names.get(id(value)) if isinstance(value, torch.nn.Parameter) else None
            if name is not None and not all(_reads_as_its_linear(user, node, name.rpartition(".")[0]) for user in node.users):
                users = _users_through_views(node)
                self.weights_read_otherwise.setdefault(name, set()).update(site.name for user in users if (site := user.meta.get("graphquant_site")))
                if any("graphquant_skip" in user.meta for user in users):
                    self.unquantized_linears.add(name.rpartition(".")[0])

    def _warn_of_unread_parameters(self) -> None:
        """Say which parameters of 2 or more dims that modules outside torch.nn hold (an expert
        stack, a LoRA factor, a weight a model multiplies itself) no compiled graph reads: the code
        using them did not run, or torch.compile ran it eagerly, where its products were not
        quantized. nn.Linear's weights have their own check; torch.nn's other modules' parameters
        (embeddings, norms, convolutions) feed no GEMM graphquant quantizes."""
        unread = [
            f"{owner}.{name}" if owner else name
            for owner, module in _outside_nested_models(self.root)
            if not type(module).__module__.startswith("torch.nn")
            for name, parameter in module.named_parameters(recurse=False)
            if parameter.dim() >= 2 and (f"{owner}.{name}" if owner else name) not in self.read_parameters
        ]
        if unread:
            user_stack.warn(
                f"graphquant: {len(unread)} parameter(s) of 2 or more dims that no compiled graph reads "
                f"({', '.join(unread[:4])}{', ...' if len(unread) > 4 else ''}): the code using them did not run, or "
                "torch.compile ran it eagerly, where their products run in high precision (TORCH_LOGS=graph_breaks says "
                "where a frame was skipped)"
            )

    def _warn_of_unreduced_amaxes(self) -> None:
        """Say where a run of several processes reduces no amax though the user meant it to: its
        quantizers ask for the reduction but the recipe names no group, or the recipe names a group
        but none of its quantizers asks. Either way each rank scales from its own amaxes."""
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() < 2:
            return
        asking = sorted({str(role) for plan in self.plans for role, q in plan.slots if q.asks_amax_reduction})
        if asking and self.planner.recipe.amax_reduction_group is None:
            user_stack.warn(
                f"graphquant: {len(asking)} slot(s) ask to all-reduce their amaxes ({asking[0]}, ...), but the recipe names no "
                "amax_reduction_group, so each of the run's processes scales from its own: give the recipe one "
                "(CustomRecipe(..., amax_reduction_group=torch.distributed.group.WORLD) after init_process_group)"
            )
            return
        per_tensor = sorted({str(role) for plan in self.plans for role, q in plan.slots if q.per_tensor_amax})
        if per_tensor and not asking and self.planner.recipe.amax_reduction_group is not None:
            user_stack.warn(
                f"graphquant: the recipe names an amax_reduction_group, but none of its {len(per_tensor)} per-tensor slot(s) "
                f"({per_tensor[0]}, ...) asks to all-reduce its amax, so each of the run's processes scales from its own: "
                "ask in the factory (Float8CurrentScalingQuantizer(..., with_amax_reduction=True), "
                "NVFP4Quantizer(..., with_amax_reduction=True), delayed scaling's reduce_amax=True)"
            )

    def _warn_of_shared_state(self, frame: Frame, sites: Sequence[Any], plan: Plan) -> None:
        """Say where a graph's products keep delayed-scaling state but belong to no module the
        graph is guarded on, in code several modules of the model run: a method Dynamo resumed
        after a graph break past which it reaches no module of its own (attention after a logger
        call), or the whole method of a module that lifts no parameter. Every such module runs
        this one graph, so they would share one slot: amax histories mixed across layers, and a
        backward after two of them fails (the first's saved state was written over)."""
        held = [name for _, name in frame.modules]
        unowned = [site for site in sites if not any(site.name == name or site.name.startswith(name + ".") for name in held)]
        stateful = _keeping_state(unowned, plan)
        shared = _code_several_modules_run(self.root) if stateful else ""
        if shared:
            user_stack.warn(
                f"graphquant: {', '.join(stateful[:3])}{', ...' if len(stateful) > 3 else ''} keep delayed-scaling state in "
                f"{shared} through this one graph, which holds none of them: they share those slots (their amax histories "
                "mix, and a backward after two calls fails). Remove the graph break that split the method "
                "(TORCH_LOGS=graph_breaks says where), or give these products a stateless quantizer (current scaling, MXFP8, "
                "blockwise) in the recipe's factory"
            )

    def _warn_of_names_taken(self, stateful: list[str]) -> None:
        """Say where sites keeping delayed-scaling state take a name that a graph this forward call
        compiled before gave its own sites: code compiled anew for another call of it (a helper
        ``def expert(self, x, w)`` that breaks its graph, called with the up and then the down
        projection's weight; a module whose own forward breaks, called twice) names its sites as
        the first compile did, so both calls quantize through one slot, the second weight with the
        first's scale history."""
        taken = {g.site for plan, origin in zip(self.plans, self.plan_origins) if origin.call == self.calls for g in plan.gemms}
        repeated = [label for label in stateful if label in taken]
        if repeated:
            user_stack.warn(
                f"graphquant: {', '.join(repeated[:3])}{', ...' if len(repeated) > 3 else ''} name products of a graph compiled "
                "again in this forward call (code that breaks its graph and runs for two products, such as one helper "
                "called with two weights, or a module whose own forward breaks, called twice): they share delayed-scaling "
                "slots with the earlier graph's, so one quantizes with a scale the other's amaxes made. Remove the graph "
                "break (TORCH_LOGS=graph_breaks says where), or give these products a stateless quantizer (current "
                "scaling, MXFP8, blockwise) in the recipe's factory"
            )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a resumed run needs to continue bit for bit (RunState.state_dict): save it beside the
        model's own state_dict, which stays the plain weights."""
        return self.run_state.state_dict()

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue from a ``state_dict()`` (RunState.load_state_dict)."""
        self.run_state.load_state_dict(state, planned=bool(self.plans))

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        """The compiled graph, or where its plan fails, a graph that raises the PlanError (or the
        MixedDtypesError of operands that torch would refuse) when run:
        raised here, Dynamo would wrap it in BackendCompilerFailed (its message on the second line)
        or, under suppress_errors, run the model eagerly and unquantized. A failure on fake tensors
        (a format's quantize reading a value on the host), which Dynamo takes for a graph break and
        runs eagerly, unquantized, is such a PlanError too."""
        try:
            return self._compile(gm, example_inputs)
        except exceptions_allowed_to_be_fallback as error:
            refusal = PlanError(_failed_on_fake_tensors(error))
        except (PlanError, MixedDtypesError) as error:
            refusal = error
        self.refusals.append(str(refusal))
        if self.dump_dir:
            from graphquant.dump import dump_refusal

            dump_refusal(self.dump_dir, gm.code, refusal)
        return _raising(refusal)

    def _compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        gm = copy_dynamo_graph(gm)
        number_module_calls(gm)
        captured = gm.code if self.dump_dir else ""
        drop_frozen_weight_stand_ins(gm)
        self._note_read_parameters(gm, example_inputs)
        code = _compiling_code()
        frame = self._counting_on(self._frame(gm, example_inputs), code)
        make_operands_positional(gm)
        fold_linears(gm, example_inputs)
        if self.planner.recipe.fp8_dpa:
            fold_attention(gm)
        sites = find_gemms(gm, example_inputs, frame, self.run_state.functional_numbers)
        if self.root is not None:
            self._record_expert_weights(gm, example_inputs)
            sites = mark_frozen_stacks(gm, example_inputs, sites, self._frozen_stacks())
        if self.planner.recipe.fp8_dpa:
            attention = find_attention(gm, frame, self.run_state.functional_numbers)
        else:
            attention = []
            leave_attention_in_high_precision(gm)
        hidden: dict[str, list[str]] = collections.defaultdict(list)  # one warning a function, not a call
        for node in mark_opaque_products(gm):
            hidden[node.meta["graphquant_skip"]].append(_described(node, frame))
        for why, calls in hidden.items():
            user_stack.warn(f"graphquant: {why} ({len(calls)} call(s) in this graph, the first {calls[0]})")
        calls = _largest_calls(gm, frame)
        self._note_weights_read_otherwise(gm, example_inputs)  # once every call the plan lists as not quantized is marked
        self.unquantized_linears.update(n.meta[UNQUANTIZED_LINEAR] for n in nodes_and_bodies(gm) if UNQUANTIZED_LINEAR in n.meta)
        skipped = [(_described(n, frame), _in_model_names(n.meta["graphquant_skip"], frame)) for n in nodes_and_bodies(gm) if "graphquant_skip" in n.meta]
        device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
        training = self.mode != "inference" and torch.is_grad_enabled()
        plan = self.planner.plan(sites, device, training=training, skipped=skipped, attention=attention)
        self._warn_of_shared_state(frame, [*sites, *attention], plan)
        self._warn_of_names_taken(_keeping_state([*sites, *attention], plan))
        if self.mode == "inference" and torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in example_inputs):
            user_stack.warn(
                "graphquant.compile(..., mode='inference') makes no backward, but this call runs with grad enabled on "
                "tensors that require grad: no gradient flows through its GEMMs (backward() fails, or leaves their "
                "operands without .grad). Call the model under torch.no_grad() or torch.inference_mode(), or compile "
                "with mode=None (or 'training') to train it."
            )
        keys = rewrite(
            gm,
            plan,
            lambda role: self._delayed(plan, role),
            needs_rng=self._needs_rng(plan, training),
            inference=not training,
            amax_group=distributed.group_name(self.planner.recipe.amax_reduction_group),
        )
        if not training:
            merge_gemms_sharing_x(gm)
        experts = {str(role): site.w_shape[0] for site in sites if site.form == GROUPED for role in site.roles()}
        fresh, unloaded = self.run_state.starting_afresh(keys, {str(role) for role, _ in plan.slots if not role.backward})
        providers = [self._provider(key, plan, device, experts.get(key)) for key in keys]
        if unloaded:
            user_stack.warn(
                f"graphquant: this graph starts {len(unloaded)} slot(s) that the loaded state has no entry for "
                f"({', '.join(unloaded[:3])}{', ...' if len(unloaded) > 3 else ''}), afresh (delayed scaling at scale 1 with no "
                "history, stochastic rounding from step 0), so the run does not continue the saved one bit for bit: was the "
                "state saved from a model of other module names, under another recipe, or before these modules ran?"
            )
        elif fresh and not training:
            user_stack.warn(
                f"graphquant: this inference call starts {len(fresh)} delayed-scaling slot(s) with no amax history "
                f"({', '.join(fresh[:3])}{', ...' if len(fresh) > 3 else ''}) and quantizes them at scale 1, as "
                "TransformerEngine's first step does, which flushes small values to zero; load the training run's state "
                "first (compiled.graphquant.load_state_dict), or make a warm-up call before using the outputs"
            )
        if self.dump_dir:
            from graphquant.dump import dump_graph

            dump_graph(self.dump_dir, captured, gm, plan)
        compiled = self._inner()(gm, [*example_inputs, *_static_shapes([p() for p in providers])])
        # Recorded once the graph is compiled: Dynamo abandons a trace whose compile asks it to
        # restart (Python scalars made tensors under dynamic shapes), and traces the frame again.
        self.plans.append(plan)
        self.plan_origins.append(_PlanOrigin(training, self.calls, code, calls))
        if not providers:  # nothing to add at each call: no frame of ours on the call's path
            return compiled
        stochastic = "rng" in keys
        # What a recompute inside a backward pass (torch.utils.checkpoint's, from outside the model)
        # would quantize otherwise than the forward did: a forward slot's delayed scale, moved by the
        # forward, and a forward slot's random bits. A step that the backward alone draws from may
        # be drawn by the recompute where the forward drew none (a reentrant checkpoint's forward
        # runs under no_grad), not a second time.
        forward_draws = any(q.stochastic for role, q in plan.slots if not role.backward)
        recomputed_otherwise = [key for key in keys if moved_by_a_recompute(key) and (key != "rng" or forward_draws)]
        watched = bool(recomputed_otherwise) or stochastic  # else a recompute is no concern of this graph's
        run_state = self.run_state

        def run(*args: Any) -> Any:
            fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
            if fake is not None:  # Dynamo's DDP optimizer runs a compiled piece on fake tensors to compile the next
                return compiled(*args, *(fake.from_tensor(p()) for p in providers))
            recompute = watched and torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1
            if recompute and (recomputed_otherwise or (stochastic and run_state.forward_drew)):
                raise _recomputed(recomputed_otherwise or ["rng"])
            if stochastic:
                run_state.advance()
                run_state.forward_drew |= not recompute
            return compiled(*args, *(p() for p in providers))

        return run

    def _record_expert_weights(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        """Note how ``gm``'s grouped sites read the model's parameters, for graphquant.freeze; a
        parameter two graphs read differently cannot be frozen for both."""
        names = {id(p): name for name, p in self.root.named_parameters()}
        for name, read in expert_weights(gm, example_inputs, names).items():
            before = self.expert_weights.setdefault(name, read)
            if before != read:
                sites = tuple(sorted({*before.sites, *read.sites}))
                why = next((r.why for r in (before, read) if isinstance(r, UnfreezableStack)), f"read by {' and '.join(sites)}")
                self.expert_weights[name] = UnfreezableStack(sites, why)

    def _frozen_stacks(self) -> dict[int, FrozenStack]:
        """The id of each stand-in that graphquant.freeze put in an expert stack's place -> the stack."""
        from graphquant.freezing import FrozenExperts  # which imports this module

        stacks = {}
        for frozen in (m for m in self.root.modules() if isinstance(m, FrozenExperts)):
            stand_in = getattr(self.root.get_submodule(frozen.name.rpartition(".")[0]), frozen.parameter)
            if stand_in.stride(0) != 0:
                user_stack.warn(f"{frozen.name}'s stand-in holds every expert ({stand_in.untyped_storage().nbytes() / 2**20:.0f} MiB of NaN): "
                                "Module.to copied it; call graphquant.freeze(model) again to make it one expert's")
            stacks[id(stand_in)] = frozen.stack()
        return stacks

    def _frame(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Frame:
        """Which module of the model each local of the frame that ``gm`` was traced from is (the
        model itself, a submodule whose code compiles on its own after a graph break inside it,
        the modules a caller's resumed code still calls), found by matching the sources of the
        parameters ``gm`` lifts with their names in the model.

        Dynamo would run the graph for any modules of those classes, but its sites are named after
        these: the graph is guarded on each one's identity, so any other module gets a graph of
        its own. Dynamo counts recompiles per guarded module, so this also gives models compiled
        from different modules of one class their own counts where compiles are not isolated."""
        if self.root is None:
            return Frame()
        names: dict[int, list[str]] = collections.defaultdict(list)  # a tied parameter has several
        for name, parameter in self.root.named_parameters(remove_duplicate=False):
            names[id(parameter)].append(name)
        candidates: dict[str, set[str]] = {}  # each local's modules that hold every parameter it lifts
        sources = {}
        for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
            grapharg = node.meta.get("grapharg")
            if not isinstance(value, torch.nn.Parameter) or grapharg is None:
                continue
            source = _source_name(grapharg.source)
            local, relative = root_local(source), parameter_path(source)
            if local is None:
                continue
            held = {name.removesuffix(relative).rstrip(".") for name in names[id(value)] if name == relative or name.endswith("." + relative)}
            candidates[local] = candidates.get(local, held) & held
            sources.setdefault(local, grapharg.source)
        kinds = _module_kinds(gm)
        named = dict(self.root.named_modules(remove_duplicate=False))
        order = {name: i for i, name in enumerate(named)}
        modules = {}
        for local, held in candidates.items():
            if len(held) > 1:  # a tied parameter the local holds as its own: the module itself decides
                value = _frame_value(local)
                same = {name for name in held if named[name] is value}
                held = same or {name for name in held if type(named[name]) is kinds.get(local)}
            if held:  # one module, or one registered under several names: the first, as named_modules() spells it
                modules[local] = min(held, key=order.__getitem__)
                _guard_identity(sources[local])
        owners = _own_module_locals()
        for local, source in owners:
            value = _frame_value(local)
            if local not in modules and isinstance(value, torch.nn.Module) and value is not self.root:
                # A module's own frame that lifts no parameter (one of none, whose method breaks, or
                # whose method a resumed frame goes on to run): named and guarded by the module
                # itself, so that each instance gets its own graph and slots.
                held = [name for name, module in named.items() if module is value]
                if held:
                    modules[local] = held[0]
                    _guard_identity(source)
        (first, _), *stacked = owners
        own = next((modules[local] for local in (first, *_WRAPPED_SELF_LOCALS, *dict(stacked)) if local in modules), "")
        names_of: dict[int, list[str]] = collections.defaultdict(list)
        for name, module in named.items():
            names_of[id(module)].append(name)
        aliases = tuple((name, names[0], len(names), place) for names in names_of.values() if len(names) > 1 for place, name in enumerate(names))
        weights = tuple(
            (node.name, tuple(map(without_compile_wrappers, names[id(value)])))
            for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs) if names.get(id(value))
        )
        return Frame(tuple(modules.items()), own, aliases, weights)

    def _counting_on(self, frame: Frame, code: Optional[types.CodeType]) -> Frame:
        """``frame``, of a graph Dynamo traced from ``code``, with the calls its modules count on
        from (Frame.offsets): each module's calls in the graphs of other code that this forward call
        compiled before this one (the graph before a graph break), so that a module called on both
        sides of the break is a#0 and a#1, not a#0 twice. They are taken at the first compile of the
        code for these modules and kept, so that a recompile (new shapes, an evaluation), whose
        earlier graphs run from Dynamo's cache and plan nothing, names its sites as the first
        compile did. Graphs of the same code are left out: they are pieces of one trace (DDP's
        split graph), whose module stack counts calls across them, or other modules' (one method
        that breaks, run by several layers).

        Not covered (calls that share a number, as each graph counting from #0 gave): those of a
        resumed code first compiled in a forward call whose earlier graph came from the cache (one
        compiled in a call that took no graph break there); a graph that runs twice in one forward
        call (a module whose own forward breaks, called twice), or a code compiled twice in one
        (such a module called again with new shapes)."""
        if code is None:
            return frame
        key = (code, frame.modules)
        if key not in self.call_offsets:
            offsets: dict[str, int] = {}
            for origin in self.plan_origins:
                if origin.call == self.calls and origin.code is not code:
                    for name, largest in origin.largest_calls.items():
                        offsets[name] = max(offsets.get(name, 0), largest + 1)
            self.call_offsets[key] = tuple(offsets.items())
        return dataclasses.replace(frame, offsets=self.call_offsets[key])

    def _inner(self) -> Callable:
        if callable(self.inner):
            return self.inner
        if self.inner == "inductor":
            from torch._inductor import config as inductor_config
            from torch._inductor import lowering
            from torch._inductor.compile_fx import compile_fx, compile_fx_inner

            from graphquant.ops import registry
            from graphquant.passes.common_subexpressions import merging_common_subexpressions
            from graphquant.passes.result_extraction import ResultExtraction
            from graphquant.passes.saturating_cast import SaturatingCast

            # graphquant's ops are extern kernels that take each operand at its exact strides: a
            # pointwise operand that several read (x's codes, by a SwiGLU's gate and up) is realized
            # once, as aten.mm's are, rather than copied into a buffer of each op's own.
            lowering.add_needs_realized_inputs(registry.OPS)
            options = dict(self.inductor_options)
            options["post_grad_custom_post_pass"] = SaturatingCast(
                then=options.get("post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass)
            )
            options["_post_fusion_custom_pass"] = ResultExtraction(
                then=options.get("_post_fusion_custom_pass", inductor_config._post_fusion_custom_pass)
            )
            return functools.partial(compile_fx, inner_compile=merging_common_subexpressions(compile_fx_inner), config_patches=options)
        return torch._dynamo.lookup_backend(self.inner)

    @staticmethod
    def _delayed(plan: Plan, role: QuantizerRole) -> bool:
        return plan.quantizer(role).keeps_state

    @staticmethod
    def _needs_rng(plan: Plan, training: bool) -> bool:
        """Whether a GEMM of the plan rounds an operand stochastically: an inference plan's fprop
        does not, though its grad_output slots would (so it draws nothing and moves no step)."""
        return any(q.stochastic for role, q in plan.slots if training or not role.backward)

    def _provider(self, key: object, plan: Plan, device: torch.device, experts: Optional[int] = None) -> Callable[[], torch.Tensor]:
        """How the compiled wrapper obtains the extra argument ``key`` at each call; a
        delayed-scaling slot of a grouped site keeps a state for each of its ``experts``."""
        if isinstance(key, tuple):  # ("frozen", FrozenExperts name, part): read at each call, as a load may replace it
            stored, attribute = self.root.get_submodule(key[1]), f"weight_{key[2]}"
            return lambda: getattr(stored, attribute)
        if key == "rng":
            self.run_state.start_drawing(device)
            return lambda: self.run_state.rng
        role = next(r for r, _ in plan.slots if str(r) == key)
        state = self.run_state.slot(role, plan.quantizer(role), device, experts)
        return lambda: state


def drop_frozen_weight_stand_ins(gm: fx.GraphModule) -> None:
    """Remove each frozen linear's weight stand-in (graphquant::frozen_weight_stand_in, what a
    FrozenLinear's ``weight`` gives compiled code) that no node of ``gm`` uses: the model read only
    its device, dtype or shape. One that a node uses (a product, a cast) has no values to give:
    raise a PlanError naming the linear. Postcondition: no stand-in is left in ``gm`` or its bodies."""
    stand_in = torch.ops.graphquant.frozen_weight_stand_in.default
    for module in [m for m in gm.modules() if isinstance(m, fx.GraphModule)]:
        nodes = module.graph.find_nodes(op="call_function", target=stand_in)
        for node in nodes:
            if node.users:
                name = node.args[3]
                raise PlanError(
                    f"graphquant: {written_at(next(iter(node.users)))} reads the weight of {name}, which graphquant.freeze "
                    "stored quantized (a FrozenLinear, whose weight is a stand-in with no values). freeze keeps a linear whose "
                    "weight the compiled graphs read other than through its forward, once a call has compiled them: give the "
                    f"model its weights again, call it once, then graphquant.freeze it; or call the module ({name}(x)) "
                    "instead of reading its weight"
                )
            module.graph.erase_node(node)
        if nodes:
            module.recompile()


def _keeping_state(sites: Sequence[Any], plan: Plan) -> list[str]:
    """The labels of ``sites`` (GEMM or attention) whose slots keep delayed-scaling state in ``plan``."""
    return [site.label for site in sites if site.label not in plan.high_precision_calls and any(plan.quantizer(role).keeps_state for role in site.roles())]


def _failed_on_fake_tensors(error: Exception) -> str:
    """What a failure on fake tensors while compiling a graph says: which quantizer's method it came
    from where it came from one (graphquant traces each format's quantize on fake tensors)."""
    what = {
        DataDependentOutputException: "reads a tensor's value on the host (.item(), a Python branch on a tensor, numpy)",
        DynamicOutputShapeException: "makes a tensor whose shape depends on its values (nonzero, a boolean index)",
    }.get(type(error), f"calls an op fake tensors do not run ({error})")
    place = None
    trace = error.__traceback__
    while trace is not None:  # the innermost frame of a quantizer's method
        owner = trace.tb_frame.f_locals.get("self")
        if isinstance(owner, Quantizer):
            code = trace.tb_frame.f_code
            place = f"{type(owner).__name__}.{code.co_name} ({os.path.basename(code.co_filename)}:{trace.tb_lineno})"
        trace = trace.tb_next
    if place is None:
        return f"graphquant could not compile this graph ({type(error).__name__}: {error}); Dynamo would have run it eagerly, unquantized"
    return (
        f"{place} {what}: graphquant runs each format's quantize on fake tensors when it compiles a graph, so it must "
        "compute with tensor ops alone (torch.where keeps a choice that depends on values on the device); the model "
        "would have run eagerly, unquantized"
    )


def _users_through_views(node: fx.Node) -> list[fx.Node]:
    """The nodes that read ``node``, through any chain of ops that only reshape, transpose or cast
    it (a weight multiplied as ``w.t()``, or cast by autocast); other ops a model applies first
    (a mask's product) stay users."""
    users = []
    for user in node.users:
        passing = user.op in ("call_function", "call_method") and target_name(user) in VIEWS_AND_CASTS
        users.extend(_users_through_views(user) if passing else [user])
    return users


def _outside_nested_models(root: torch.nn.Module):
    """root's named modules but those of a graphquant model inside it (graphquant.compile of a
    submodule, which plans them under its own recipe in its own graphs)."""
    nested: list[str] = []
    for name, module in root.named_modules():
        if any(name.startswith(prefix) for prefix in nested):
            continue
        if name and isinstance(module.__dict__.get("graphquant"), GraphquantBackend):
            nested.append(f"{name}.")
            continue
        yield name, module


def _reads_as_its_linear(user: fx.Node, weight: fx.Node, owner: str) -> bool:
    """Whether ``user`` reads ``weight`` as the weight of the linear site of module ``owner``, or
    is that module's own product left unquantized (the plan lists it and why)."""
    if user.meta.get(UNQUANTIZED_LINEAR) == owner:
        return True
    site = user.meta.get("graphquant_site")
    return site is not None and site.form == LINEAR and site.name == owner and site_weight(user) is weight


def _graphs_are_one_autograd_node(inner: Union[str, Callable]) -> bool:
    """Whether the backend ``inner`` compiles a graph through AOT autograd, so that a compiled
    graph's products are not in the autograd graph of a call's outputs (where a graph runs as it
    is, as under "eager" or explain's, its products stand there beside the eager code's)."""
    return isinstance(inner, str) and (inner in ("inductor", "cudagraphs") or inner.startswith("aot_"))


def _recomputed(stateful: list[str]) -> RuntimeError:
    """The error of a training call of a graph made inside a backward pass: torch.utils.checkpoint
    recomputing a compiled block from outside it, which would move the graph's state again."""
    state = "stochastic-rounding step" if stateful == ["rng"] else f"delayed-scaling state ({stateful[0]}, ...)"
    # Where only the backward draws, a forward that drew nothing (under no_grad) makes the recompute the one draw.
    reentrant = ", or checkpoint it with use_reentrant=True" if stateful == ["rng"] else ""
    return RuntimeError(
        "graphquant: a compiled graph was called with grad enabled inside a backward pass, as torch.utils.checkpoint "
        f"does to recompute a compiled module from outside it; its {state} would move a second time this step, so the "
        "recompute would quantize with other scales or random bits than the forward did and the gradients would be "
        "wrong. Compile the module whose forward calls torch.utils.checkpoint (graphquant then recomputes inside the "
        "graph with the forward's stochastic-rounding step; delayed scaling of forward slots inside a checkpoint it "
        "refuses), or give the checkpointed modules' forward slots a stateless recipe (current scaling, MXFP8, "
        f"blockwise FP8, NVFP4 without stochastic rounding){reentrant}"
    )


def _in_model_names(reason: str, frame: Frame) -> str:
    """A pass's reason with each parameter Dynamo named by its source ("the tensor
    l_self_parameters_temperature_") as the model names it ("the tensor temperature")."""
    weights = dict(frame.weights)
    return re.sub(r"\w+", lambda word: weights.get(word[0], (word[0],))[0], reason)


def _described(node: fx.Node, frame: Frame) -> str:
    """A node of the plan's "not quantized" list as a reader finds it: its owner as
    named_modules() spells it ("the model" for its own code), and the call, a parameter by its
    name in the model, not Dynamo's ("layers.0.attn: softmax = softmax(mul, dim=-1)", "stem:
    conv2d = conv2d(l_x_, stem.weight, stem.bias, ...)")."""
    owner = owner_of(node, frame)[0] or "the model"

    def shown(value: object) -> str:
        return _in_model_names(value.name, frame) if isinstance(value, fx.Node) else repr(value)

    arguments = [shown(a) for a in node.args] + [f"{key}={shown(value)}" for key, value in node.kwargs.items()]
    return f"{owner}: {node.name} = {target_name(node)}({', '.join(arguments)})"


def _static_shapes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The extra inputs the rewrite added (slot state, stored weights) as the fake tensors of the
    compile's tracing, with their shapes fixed: handed over as real tensors without a source of
    Dynamo's, each dim would become a symbol that no guard can name, and an op relating it to a
    static size (a grouped site's per-expert delayed scales beside its amaxes) would fail to
    compile."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    if context is None or context.fake_mode is None:
        return tensors
    return [context.fake_mode.from_tensor(tensor, static_shapes=True) for tensor in tensors]


def _raising(error: Exception) -> Callable:
    def run(*args: Any) -> Any:
        raise error.with_traceback(None)

    return run


# The locals through which a wrapper passes a frame's own module (HuggingFace's decorators).
_WRAPPED_SELF_LOCALS = ("L['fn']", "L['args'][0]")


def _self_name() -> str:
    """The local through which the compiling frame's method holds its own module: its first
    parameter, whatever the method calls it (``def forward(s, x)``; in code resumed after a graph
    break, the resumed method's, which the resumed frame keeps as its local). "self" where the
    frame runs no method of that parameter's class: a function's module argument
    (transformers' ``eager_attention_forward(module, ...)``) is not the function's owner."""
    code = _compiling_code()
    method = code and _resumed_code(code)
    if method is None or not method.co_argcount:
        return "self"
    first = method.co_varnames[0]
    return first if _method_code(_frame_locals().get(first), method.co_name) is method else "self"


def _method_code(module: object, name: str) -> Optional[types.CodeType]:
    """The code of the method ``name`` of ``module``'s class, under its decorators; None where it has none."""
    return getattr(inspect.unwrap(getattr(type(module), name, None) or (lambda: None)), "__code__", None)


def _resumed_code(code: types.CodeType) -> types.CodeType:
    """The method's code that ``code`` resumes after a graph break (Dynamo keeps it for the
    resume functions it generates); ``code`` itself where it resumes none."""
    from torch._dynamo.resume_execution import ContinueExecutionCache

    resumed = ContinueExecutionCache.generated_code_metadata.get(code)
    return code if resumed is None else resumed.code


def _own_module_locals() -> list[tuple[str, Any]]:
    """The locals (with their sources) through which the frame Dynamo is compiling holds the module
    whose code it runs: its first parameter (L['self']), and in code resumed after a graph break
    inside an expression (``return self.merge(attend(q, k, v))``), the module of each bound method
    left on the stack (L['___stack0'].__self__), whose code the frame goes on to run."""
    from torch._dynamo.source import AttrSource, LocalSource

    stacked = [
        name for name, value in _frame_locals().items()
        if re.fullmatch(r"___stack\d+", name) and isinstance(getattr(value, "__self__", None), torch.nn.Module)
    ]
    first = _self_name()
    return [(f"L['{first}']", LocalSource(first)), *((f"L['{name}'].__self__", AttrSource(LocalSource(name), "__self__")) for name in stacked)]


def _largest_calls(gm: fx.GraphModule, frame: Frame) -> dict[str, int]:
    """Each module owning a site of ``gm`` (GEMM or attention) with the largest of its call numbers there."""
    calls: dict[str, int] = {}
    for node in nodes_and_bodies(gm):
        if "graphquant_site" in node.meta or "graphquant_attention" in node.meta:
            owner, call, _ = owner_of(node, frame)
            calls[owner] = max(call, calls.get(owner, call))
    return calls


def _compiling_code() -> Optional[types.CodeType]:
    """The code of the frame Dynamo is compiling (a method, or its code resumed after a graph
    break); None where there is none (a graph handed over otherwise)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx().f_code
    except Exception:
        return None


def _code_several_modules_run(root: Optional[torch.nn.Module]) -> str:
    """The method ("Attn.forward at attention.py:13, which 2 modules of the model run") whose code
    is the frame Dynamo is compiling (resumed after a graph break, or whole), where more than one
    module of the model runs it; '' otherwise (one module or none, no model, no frame)."""
    code = _compiling_code()
    if root is None or code is None:
        return ""
    method = _resumed_code(code)
    resumed = re.fullmatch(r"torch_dynamo_resume_in_\w+_at_(\d+)", code.co_name)
    function, line = method.co_name, int(resumed[1]) if resumed else code.co_firstlineno

    runners = [module for module in root.modules() if _method_code(module, function) is method]
    if len(runners) < 2:
        return ""
    return f"{type(runners[0]).__name__}.{function} at {os.path.basename(code.co_filename)}:{line}, which {len(runners)} modules of the model run"


def _frame_value(source: str) -> object:
    """The value a source of the frame Dynamo is compiling names ("L['stack0']", "L['mods'][1]",
    "L['self']._modules['fc']._parameters['weight']"), or None where it cannot be read."""
    if not source.startswith("L["):
        return None
    value: object = _frame_locals()
    try:
        for attribute, index, key in re.findall(r"\.(\w+)|\[(\d+)\]|\['([^']*)'\]", source[1:]):
            value = getattr(value, attribute) if attribute else value[int(index)] if index else value[key]
        return value
    except Exception:  # a source of another form
        return None


def _frame_locals() -> dict[str, object]:
    """The locals of the frame Dynamo is compiling ({} where there is none: a graph handed over otherwise)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx().f_locals
    except Exception:
        return {}


def _module_kinds(gm: fx.GraphModule) -> dict[str, type]:
    """The class of the module each frame local is, where a node's module stack says so."""
    kinds = {}
    for node in gm.graph.nodes:
        for path, kind in (node.meta.get("nn_module_stack") or {}).values():
            if root_local(path) == path:
                kinds[path] = kind
    return kinds


def _source_name(source: Any) -> str:
    name = source.name
    return name() if callable(name) else name


def _guard_identity(parameter_source: Any) -> None:
    """Make Dynamo run the graph it is compiling only for the module that ``parameter_source``
    starts from (L['self'], or where a wrapper passes it, L['fn'] or L['args'][0]): an ID_MATCH
    guard on the source of that module, under the wrappers that only mark it as a module (the
    guard on a plain local is also the one Dynamo counts recompiles by)."""
    from torch._dynamo.guards import GuardBuilder, install_guard

    module = parameter_source
    while fqn_from_stack_path(_source_name(module)):
        module = module.base
    while getattr(module, "base", None) is not None and _source_name(module.base) == _source_name(module):
        module = module.base
    install_guard(module.make_guard(GuardBuilder.ID_MATCH))


def copy_dynamo_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a Dynamo graph that keeps what AOTAutograd reads from it (Dynamo reads the original)."""
    graph = copy.deepcopy(gm.graph)
    new = fx.GraphModule(gm, graph)
    new.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        new._param_name_to_source = gm._param_name_to_source
    for old_node, new_node in zip(gm.graph.find_nodes(op="placeholder"), graph.find_nodes(op="placeholder")):
        new_node._dynamo_source = getattr(old_node, "_dynamo_source", None)
    return new


def compile(
    model: Union[torch.nn.Module, Callable],
    recipe: CustomRecipe,
    *,
    backend: Union[str, Callable] = "inductor",
    strict: bool = False,
    mode: Optional[str] = None,
    seed: int = 0,
    dump_dir: Optional[str] = None,
    compile_mode: Optional[str] = None,
    options: Optional[dict] = None,
    **torch_compile_kwargs: Any,
) -> Any:
    """``model`` under torch.compile with every GEMM quantized as ``recipe`` says.

    The first call compiles; then ``model.graphquant.plan`` is the plan of the graphs the latest
    compiling call of the latest call's kind (training or not) compiled, a graph break's together
    (print it for the table: each GEMM's formats, backend and bucket) and
    ``model.graphquant.plans`` lists every graph's. ``graphquant.explain`` gives the plan without
    a training step. A recipe the model cannot run raises graphquant.PlanError on that first call.

    backend: what compiles the rewritten graph ("inductor", "aot_eager", or any backend).
    strict: make every GEMM that is not native on this device an error.
    mode: "inference" makes no backward representations even with grad enabled; None decides
        per call from torch.is_grad_enabled().
    seed: the stochastic-rounding seed, an int64; with the same seed, runs are bit for bit reproducible. The
        step advances at each call of a graph whose GEMMs round stochastically (an inference call
        draws nothing and leaves it), so a forward that graph breaks splits into two steps.
    dump_dir: write each captured graph, its rewritten form and its plan there, or where its plan is
        refused, the refusal (default: the environment variable GRAPHQUANT_DUMP, if set).
    compile_mode, options: torch.compile's ``mode`` and ``options``, for the Inductor backend
        (e.g. compile_mode="reduce-overhead" for CUDA graphs).
    disable=True (torch.compile's switch, as in ``disable=not args.compile``) returns ``model``
    itself, as torch.compile does: it runs in high precision, quantizing nothing.
    """
    if not callable(model):
        raise TypeError(f"graphquant.compile takes the nn.Module or function to compile, got {type(model).__name__}")
    model = _uncompiled(model)
    if dump_dir is None:
        dump_dir = os.environ.get("GRAPHQUANT_DUMP") or None
    from torch._inductor import list_mode_options

    inductor_options = {**(list_mode_options(compile_mode) if compile_mode else {}), **(options or {})}
    if inductor_options and backend != "inductor":
        raise ValueError(f"compile_mode and options configure Inductor; backend {backend!r} takes neither")
    gq_backend = GraphquantBackend(
        recipe,
        inner=backend,
        strict=strict,
        mode=mode,
        seed=seed,
        dump_dir=dump_dir,
        inductor_options=inductor_options,
        root=_named_root(model),
    )
    if torch_compile_kwargs.get("disable"):  # after the checks of the arguments, which the switch hides no error of
        return model
    compiled = torch.compile(model, backend=gq_backend, **(_ISOLATED | torch_compile_kwargs))
    name = type(model).__name__ if isinstance(model, torch.nn.Module) else getattr(model, "__name__", repr(model))
    if isinstance(compiled, torch.nn.Module):
        # Dynamo calls its callback only where a frame has no graph yet (to compile it, or to find
        # it may not): the flag is set there, and a call that runs a compiled graph pays nothing.
        context = compiled.dynamo_ctx
        callback = context.callback
        context.callback = _failing_past_the_recompile_limit(callback, name, gq_backend)
        context.callback._torchdynamo_orig_backend = callback  # where Dynamo finds the backend behind a callback
        compiled._initialize()
        generates = callable(getattr(type(model), "generate", None))
        compiled.forward = _each_call(compiled.forward, name, gq_backend, notes_the_thread=generates)
        _kept_whole(compiled, name)
        compiled.forward = _checking_the_first_compile(compiled.forward, gq_backend, name, functools.partial(setattr, compiled, "forward"))
        twin = functools.partial(
            compile, recipe=recipe, backend=backend, strict=strict, mode=mode, seed=seed, dump_dir=dump_dir,
            compile_mode=compile_mode, options=options, **torch_compile_kwargs,
        )
        compiled.__dict__["__deepcopy__"] = functools.partial(_deep_copy, model, gq_backend, twin)
        compiled.__dict__["__reduce_ex__"] = _not_pickled
        compiled.__dict__["__prepare_scriptable__"] = functools.partial(_not_scripted, name)
        from graphquant.freezing import pointing_to_freeze  # which imports this module

        compiled.register_load_state_dict_pre_hook(pointing_to_freeze)
        watch_methods(compiled, model, "forward and generate" if generates else "forward", attention=recipe.fp8_dpa)
        if generates:
            forwards = {
                module: _compiled_function(torch.compile(type(module).forward.__get__(module), backend=gq_backend, **(_ISOLATED | torch_compile_kwargs)), name, gq_backend)
                for module in _generated_through(model)
            }
            gq_backend.module_forwards = forwards
            generate = _generating_through(model, forwards, name)
            compiled.__dict__["generate"] = _checking_the_first_compile(generate, gq_backend, name, functools.partial(compiled.__dict__.__setitem__, "generate"))
    else:
        compiled = _checking_the_first_compile(_compiled_function(compiled, name, gq_backend), gq_backend, name)
    compiled.__dict__["graphquant"] = gq_backend
    return compiled


def _uncompiled(model: Any) -> Any:
    """The module a torch.compile'd model wraps (graphquant compiles it itself, and names its
    sites as the module names them); a graphquant model is refused, not compiled twice."""
    while isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        if "graphquant" in model.__dict__:
            raise TypeError(
                f"graphquant: this {type(model._orig_mod).__name__} is already a graphquant model; to compile, explain or "
                "report it under another recipe, pass the module it wraps (model._orig_mod)"
            )
        model = model._orig_mod
    return model


def _checking_the_first_compile(
    call: Callable, backend: "GraphquantBackend", name: str, put_back: Optional[Callable] = None
) -> Callable:
    """``call`` that, once a call of it has compiled graphs, has the backend check them whole
    (GraphquantBackend.check_the_first_compile, once a model: its forward's or its generate's),
    and the first call with grad enabled its products outside them (check_eager_products);
    ``put_back(call)`` then puts the plain call back, so that later calls run no frame of ours (a
    compiled function, which has no attribute to put it back in, reads the backend's flags). A
    model of mode=None called under no_grad alone keeps this frame at each call: the first
    training call may come at any time.
    Dynamo does not trace it: an enclosing torch.compile making the model's first call would
    otherwise inline ``call``'s code (whose attributes a plain wrapper copies) into its own graph,
    unquantized; it breaks its graph here instead, as _kept_whole has it do at the model.
    Threads that make the first call at once (a server's warm-up) take it in turn: the first
    compiles, the others run its graphs (Dynamo compiled a graph in each, and past its recompile
    limit refused the rest)."""

    @functools.wraps(call, assigned=("__module__", "__name__", "__qualname__", "__doc__"), updated=())
    def first(*args: Any, **kwargs: Any) -> Any:
        if backend.first_call_checked:
            return checked(*args, **kwargs)
        with backend.first_compile:
            return checked(*args, **kwargs)

    def checked(*args: Any, **kwargs: Any) -> Any:
        checking = not backend.eager_products_checked and torch.is_grad_enabled()
        since = next_node_number() if checking else 0
        before = len(backend.plans)
        try:
            result = call(*args, **kwargs)
        finally:
            if len(backend.plans) > before:
                backend.check_the_first_compile()
        if not backend.plans:
            backend.check_the_first_compile()  # a call that compiled no graph at all
        if checking and backend.first_call_checked and not backend.eager_products_checked:
            backend.check_eager_products(result, since)
        if backend.first_call_checked and backend.eager_products_checked and put_back is not None:
            put_back(call)
        return result

    return _own_graph(first, name)


def _own_graph(call: Callable, name: str) -> Callable:
    """``call``, at which an enclosing torch.compile breaks its graph and which it calls as it is:
    it would otherwise inline the code, and graphquant's compiled function inside it, into its own
    graph, unquantized (a flag of Dynamo's on a plain function is not enough: it traces into it)."""
    disabled = torch._dynamo.disable(call, reason=_own_graph_reason(name))
    disabled.__dict__.pop("_torchdynamo_orig_callable", None)  # torch.compile(it) would unwrap it to call, and trace that
    return disabled


def _named_root(model: Any) -> Optional[torch.nn.Module]:
    """The module whose names the sites take: a DistributedDataParallel's wrapped module (Dynamo
    traces its code, whether DDPOptimizer splits the graph or not), else the model itself; None
    for a function."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    return model if isinstance(model, torch.nn.Module) else None


def _kept_whole(compiled: torch.nn.Module, name: str) -> None:
    """Have an enclosing torch.compile call ``compiled`` as it is, quantized, and not inline its
    module's code into a graph of its own backend, unquantized (Dynamo then breaks the graph at the
    call); nor unwrap it to its module when it compiles ``compiled`` itself."""
    compiled.forward._torchdynamo_disable = True
    compiled.forward._torchdynamo_disable_msg = _own_graph_reason(name)
    for unwrapping in ("_torchdynamo_orig_callable", "get_compiler_config"):
        compiled.__dict__.pop(unwrapping, None)


def _own_graph_reason(name: str) -> str:
    """Why an enclosing torch.compile breaks its graph at a graphquant model (Dynamo's message)."""
    return (
        f"graphquant.compile compiled {name} with its own backend, which this torch.compile would bypass, so it runs as "
        "a graph of its own; for one graph, graphquant.compile the enclosing model instead (torch.export cannot take a "
        "graphquant model: export the module without graphquant)"
    )


def _generated_through(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose forwards transformers' generate calls: the model, and an
    encoder-decoder's encoder, which it runs through ``get_encoder()``, not the model's forward."""
    encoder = model.get_encoder() if getattr(getattr(model, "config", None), "is_encoder_decoder", False) else None
    return [model] + ([encoder] if isinstance(encoder, torch.nn.Module) and encoder is not model else [])


@dataclasses.dataclass
class _Installed:
    """graphquant's forward in a module a generate runs through: whose generate put it there, the
    threads whose calls of it run now (how many each), and the module's own forward attribute
    (None: the class's)."""

    generate: Callable
    threads: collections.Counter
    own_forward: Optional[Callable]

    def forward_of(self, module: torch.nn.Module, quantized: Callable) -> Callable:
        """The module's forward while installed: in a call of a graphquant model of the module
        (this one's or another recipe's), that model's own forward; else ``quantized`` in the
        threads generating, and the module's own in any other (a server's thread calling the plain
        module meanwhile asked for that)."""

        @functools.wraps(quantized)  # generate reads the forward's signature (logits_to_keep, position_ids)
        def forward(*args: Any, **kwargs: Any) -> Any:
            through = _CALLED_THROUGH.get()
            if through is not None and module in through.module_forwards:
                return through.module_forwards[module](*args, **kwargs)
            if threading.get_ident() in self.threads:
                return quantized(*args, **kwargs)
            return (self.own_forward or type(module).forward.__get__(module))(*args, **kwargs)

        return forward


# The graphquant model (its backend) whose call this thread is in: a module forward that a generate
# has put in runs that model's forward for it (_Installed.forward_of).
_CALLED_THROUGH: contextvars.ContextVar[Optional[GraphquantBackend]] = contextvars.ContextVar("graphquant_called_through", default=None)

# The modules graphquant generates run through now, under one lock for every model.
_GENERATING: "weakref.WeakKeyDictionary[torch.nn.Module, _Installed]" = weakref.WeakKeyDictionary()
_GENERATING_LOCK = threading.Lock()


def _generating_through(model: torch.nn.Module, forwards: dict[torch.nn.Module, Callable], name: str) -> Callable:
    """``model.generate`` (transformers' GenerationMixin, which calls the module itself, not the
    compiled model, and an encoder-decoder's encoder by itself) with each call of those modules'
    forwards run by ``forwards``, graphquant's compiles of them, each its own graph (_own_graph):
    transformers compiles the decode step of a static cache itself. Calls that overlap (a server's
    threads) share one installation: the first puts the forwards in, the last takes them out (each
    putting back what it found let the first to end take the others' forwards away, whose later
    steps then ran unquantized, and left graphquant's forward in the module for good), and other
    threads calling the module meanwhile get its own forward. Another graphquant model of the same
    module cannot generate meanwhile: the module has one forward."""

    @functools.wraps(type(model).generate)
    def generate(*args: Any, **kwargs: Any) -> Any:
        with _GENERATING_LOCK:
            if any(module in _GENERATING and _GENERATING[module].generate is not generate for module in forwards):
                raise RuntimeError(
                    f"graphquant: another graphquant model of this {type(model).__name__} is generating: generate runs "
                    "through the module's forward, which one model at a time can hold; generate with one model at a time, "
                    "or compile a copy of the module (copy.deepcopy) for the other"
                )
            for module, forward in forwards.items():
                if module not in _GENERATING:
                    installed = _GENERATING[module] = _Installed(generate, collections.Counter(), module.__dict__.get("forward"))
                    module.forward = _own_graph(installed.forward_of(module, forward), name)
                _GENERATING[module].threads[threading.get_ident()] += 1
        try:
            return model.generate(*args, **kwargs)
        finally:
            with _GENERATING_LOCK:
                for module in forwards:
                    installed = _GENERATING[module]
                    installed.threads -= collections.Counter({threading.get_ident(): 1})  # drops a count that reaches 0
                    if not installed.threads:
                        if installed.own_forward is None:
                            del module.forward
                        else:
                            module.forward = installed.own_forward
                        del _GENERATING[module]

    return generate


def _deep_copy(model: torch.nn.Module, backend: "GraphquantBackend", twin: Callable, memo: dict) -> Any:
    """copy.deepcopy of a graphquant model: a graphquant model of a copy of ``model``, compiled by
    ``twin`` with the same settings, that continues from this one's delayed-scaling and
    stochastic-rounding state (its own, not shared)."""
    copied = twin(copy.deepcopy(model, memo))
    state = backend.state_dict()
    if state:  # a model not called yet has none: its copy starts afresh as it would, saying nothing
        copied.graphquant.load_state_dict(state)
    return copied


class RecompileLimitError(RuntimeError):
    """Dynamo reached its recompile limit in a graphquant model, which would then run unquantized."""


def _not_pickled(protocol: int) -> NoReturn:
    """A graphquant model's pickling (torch.save of the model, or of a module holding it) and
    copy.copy: its compiled graphs and the backend's closures do not pickle, and a shallow copy
    would lose the backend, so say what a copy and a checkpoint take instead."""
    raise TypeError(
        "a graphquant model does not pickle or shallow-copy (torch.save(model), pickle.dumps, copy.copy, or a module "
        "holding it): copy.deepcopy(model) makes a graphquant model of its own; to checkpoint, save "
        "model.state_dict() and compiled.graphquant.state_dict() (its delayed-scaling and stochastic-rounding state), "
        "then load them into the module and into graphquant.compile(module, recipe) again, as README's checkpoint example does"
    )


def _compiled_function(compiled: Callable, name: str, backend: "GraphquantBackend") -> Callable:
    """A torch.compile'd function as graphquant runs it: checked at each call as a module's forward is."""
    return _each_call(_failing_past_the_recompile_limit(compiled, name, backend), name, backend)


def _each_call(call: Callable, name: str, backend: "GraphquantBackend", notes_the_thread: bool = False) -> Callable:
    """``call`` with what graphquant does at every call, the only Python of graphquant's on a
    compiled call once the first call's checks are done: refuse what would run the model's code
    unquantized, past graphquant's backend (torch.export, and what exports through it: ONNX,
    AOTInductor, which runs a compiled module's code as it is for its own trace; torch.func's
    transforms, under which Dynamo runs it eagerly and skips that code for good), either of which
    may come at any call; count the call and note whether it trains, for ``backend.plan``, and
    that it has drawn no random bits yet, for a recompute of it inside a backward pass; and, for a
    module that generates (``notes_the_thread``), note whose call the thread is in, for a forward
    that a generate has put in (_Installed.forward_of)."""

    @functools.wraps(call, assigned=("__module__", "__name__", "__qualname__", "__doc__"), updated=())
    def run(*args: Any, **kwargs: Any) -> Any:
        backend.training_call = backend.mode != "inference" and torch.is_grad_enabled()
        backend.calls += 1
        if backend.run_state.forward_drew and torch._C._current_graph_task_id() == -1:  # a call, not a recompute in a backward
            backend.run_state.forward_drew = False
        if torch.compiler.is_exporting():
            raise RuntimeError(
                f"graphquant: torch.export of {name} would export its code unquantized (graphquant quantizes in "
                "torch.compile's backend, which export does not run); export the module without graphquant, or serve the "
                "graphquant model itself: mode='inference', graphquant.freeze for its quantized weights alone, "
                "compile_mode='reduce-overhead' for CUDA graphs"
            )
        if torch._C._functorch.peek_interpreter_stack() is not None:
            raise RuntimeError(
                f"graphquant: {name} does not run under torch.func transforms (grad, vmap, jacrev, ...): Dynamo would run "
                "its code eagerly, unquantized, and skip that code for good, so that later calls also ran unquantized; "
                "call the model outside the transform (torch.autograd.grad gives gradients; functional_call works)"
            )
        if not notes_the_thread:
            return call(*args, **kwargs)
        token = _CALLED_THROUGH.set(backend)
        try:
            return call(*args, **kwargs)
        finally:
            _CALLED_THROUGH.reset(token)

    return run


def _not_scripted(name: str) -> NoReturn:
    """torch.jit.script of a graphquant model (or of a module holding it), which asks each module
    to prepare itself first: TorchScript would compile the module's code by itself, unquantized,
    and fails on the compiled wrapper with a message of inspect's."""
    raise TypeError(
        f"graphquant: torch.jit.script cannot take the graphquant model of {name}: TorchScript compiles a module's own code, "
        "which would run unquantized; run the graphquant model itself (compile_mode='reduce-overhead' for CUDA graphs)"
    )


def _failing_past_the_recompile_limit(call: Callable, name: str, backend: "GraphquantBackend") -> Callable:
    """``call`` with Dynamo told to fail where it would run a frame eagerly, unquantized, having
    reached its recompile limit; the failure becomes a RecompileLimitError saying what to change.
    Dynamo's suppress_errors is off for it too: a failure to compile the model's code would run
    that code eagerly, unquantized, with a log line alone. ``call`` is Dynamo's callback for a
    frame it has no graph for (a module's), or the compiled function itself. The flags are
    Dynamo's own and are read only when it compiles."""
    config = torch._dynamo.config
    failing = config._make_closure_patcher(fail_on_recompile_limit_hit=True, suppress_errors=False)

    @functools.wraps(call)
    def run(*args: Any, **kwargs: Any) -> Any:
        restore = failing()
        try:
            return call(*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit as error:
            shared = "" if _ISOLATED else (
                " Before torch 2.13, the count of a module's code takes in the compiles of every model compiled from "
                "that module (graphquant.compile of it under several recipes, or torch.compile)."
            )
            if backend.refusals:
                shared += (
                    f" {len(backend.refusals)} of this model's graphs only raise the plan's refusal of the sizes they were "
                    f"compiled for, each for its sizes alone, so a raised limit brings that error back; the last: {backend.refusals[-1]}"
                )
            raise RecompileLimitError(
                f"graphquant: {name} would run unquantized: Dynamo reached its recompile limit for code this model "
                f"runs (torch._dynamo.config.recompile_limit = {config.recompile_limit} graphs of one code for one "
                f"module, accumulated_recompile_limit = {config.accumulated_recompile_limit} in all; Dynamo's warning "
                f"'hit config...' names the code) and would run that code eagerly, in high precision.{shared} Raise "
                "torch._dynamo.config.recompile_limit to run it quantized, or call torch._dynamo.reset() once the "
                "models compiled earlier are no longer used (TORCH_LOGS=recompiles says why each recompile happened)."
            ) from error
        finally:
            restore()

    return run
