"""What a run keeps from call to call beside its compiled graphs, and what a resumed run needs of
it to continue bit for bit: each delayed-scaling slot's float32 [scale, amax_history...], the
stochastic-rounding int64 [seed, step], the functional products' numbers, and what each slot's
scale was computed for; with the entries a checkpoint gave for slots no graph has planned yet."""

from __future__ import annotations

import json
import operator
from typing import Mapping, Optional

import torch

from graphquant import user_stack
from graphquant.passes.find_gemms import FunctionalNumbers
from graphquant.passes.plan import Plan, PlanError
from graphquant.quantizers import Quantizer
from graphquant.roles import QuantizerRole

# The keys of state_dict that are no slot's, each a JSON's bytes: the functional products'
# numbers, and what each delayed-scaling slot's scale was computed for (Float8DelayedScalingQuantizer.scaling).
NUMBERS = "functional_numbers"
SCALINGS = "delayed_scalings"


class RunState:
    """The state of one graphquant model's slots, over all its graphs."""

    def __init__(self, seed: int) -> None:
        self.seed = _checked_seed(seed)
        self.delayed: dict[QuantizerRole, torch.Tensor] = {}
        self.rng: Optional[torch.Tensor] = None  # [seed, step] of the latest call
        self.rng_step: Optional[torch.Tensor] = None
        # Whether the latest call outside a backward pass drew random bits (a training call of a graph
        # that rounds stochastically): its recompute inside the backward would draw them a second time.
        self.forward_drew = False
        self.waiting: dict[str, torch.Tensor] = {}  # loaded state whose slot no graph has planned yet
        self.scalings: dict[str, str] = {}  # what each delayed-scaling entry's scale is for, planned or waiting
        self.loaded = False  # load_state_dict ran: a slot it gave no entry starts afresh, which is said
        self.functional_numbers = FunctionalNumbers()  # the names of functional products, over all graphs

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of what a resumed run needs to continue bit for bit: each delayed-scaling slot's
        state under its role's string, the stochastic-rounding step under "rng" (entries loaded
        for slots not planned yet included), the numbers of the functional products met so far
        (under NUMBERS: a resumed run names them as this one did, whichever of its calls meets
        them first) and what each slot's scale was computed for (under SCALINGS). Save it beside
        the model's own state_dict, which stays the plain weights."""
        state = {key: value.clone() for key, value in self.waiting.items()}
        state.update({key: value.detach().clone() for key, value in self._live().items()})
        for key, record in ((NUMBERS, self.functional_numbers.saved()), (SCALINGS, self.scalings)):
            if record:
                state[key] = torch.tensor(list(json.dumps(record).encode()), dtype=torch.uint8)
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor], planned: bool) -> None:
        """Continue from a ``state_dict()``. An entry whose slot no graph has planned yet (all of them
        before the model's first call, where nothing is ``planned``) waits for it; after the first
        call, every planned slot needs its entry and every entry a slot (planned, or loaded before
        and still waiting)."""
        if not isinstance(state, Mapping):
            raise TypeError(f"graphquant state is a mapping of names to tensors (compiled.graphquant.state_dict()), got {type(state).__name__}")
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"graphquant state {key!r} must be a tensor, got {type(value).__name__}")
        self.loaded = True
        if NUMBERS in state and not planned:  # a graph has numbered its products already: its slots must match the entries
            self.functional_numbers.restore(_decoded(state[NUMBERS]))
        # A checkpoint of an earlier graphquant says nothing of its scales' formats.
        saved_scalings = _decoded(state[SCALINGS]) if SCALINGS in state else {}
        state = {key: value for key, value in state.items() if key not in (NUMBERS, SCALINGS)}
        strangers = [key for key in state if key != "rng" and not _names_a_role(key)]
        if strangers:
            raise KeyError(
                f"graphquant state keys are the delayed-scaling slots' roles ('module_type=linear|tensor_type=input|name=fc1') "
                f"and 'rng'; got {strangers[:3]}{' ...' if len(strangers) > 3 else ''}: load the model's own state_dict "
                "into the model, and compiled.graphquant.state_dict()'s here"
            )
        stale = [key for key in state if key != "rng" and _softmax_output_role(QuantizerRole.parse(key))]
        if stale:
            user_stack.warn(
                f"graphquant: the loaded state's attention s entries ({', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''}) "
                "are left out: that slot keeps no state now (P, at most 1, is scaled by that bound at every call); they "
                "come from a checkpoint saved by an earlier graphquant"
            )
            state = {key: value for key, value in state.items() if key not in stale}
        live = self._live()
        # The step waits for the first graph that draws (an inference call draws nothing).
        waits = {"rng"} if self.rng is None else set()
        unexpected = sorted(state.keys() - live.keys() - self.waiting.keys() - waits)
        missing = sorted(live.keys() - state.keys())
        if planned and (unexpected or missing):
            raise KeyError(
                f"graphquant state does not match the slots of this model's plan: unexpected {unexpected}, missing "
                f"{missing}; the plan's slots: {sorted(live)}. Load the state before the model's first call (each slot "
                "then takes its entry when it is planned), into a model compiled with the recipe it was saved under"
            )
        restored = {key: self._restored(key, state[key], like, saved_scalings.get(key)) for key, like in live.items()}
        waiting = {key: value.detach().clone() for key, value in state.items() if key not in live}
        if "rng" in waiting:  # a wrong seed fails here, not at the first call
            self._restored("rng", waiting["rng"], torch.tensor([self.seed, 0], dtype=torch.int64))
        self.waiting = waiting
        self.scalings = {key: scaling for key, scaling in self.scalings.items() if key in live}
        self.scalings.update((key, saved_scalings[key]) for key in waiting if key in saved_scalings)
        roles = {str(role): role for role in self.delayed}
        for key, value in restored.items():
            if key == "rng":
                self.rng = value  # a new tensor: a pending backward keeps the step of its forward
            else:
                self.delayed[roles[key]].copy_(value)

    def slot(self, role: QuantizerRole, quantizer: Quantizer, device: torch.device, experts: Optional[int] = None) -> torch.Tensor:
        """The state of a delayed-scaling slot, made (from its loaded entry, where one waits) the first
        time a graph plans it; a grouped site's keeps a state for each of its ``experts``."""
        if role not in self.delayed:
            key = str(role)
            saved_scaling = self.scalings.get(key)
            self.scalings[key] = quantizer.scaling
            scale, history = quantizer.initial_state(device, experts)
            self.delayed[role] = self._initial(key, torch.cat([scale, history], -1), saved_scaling)
        return self.delayed[role]

    def start_drawing(self, device: torch.device) -> None:
        """Make the stochastic-rounding step, from its loaded entry where one waits, the first time a
        graph draws."""
        if self.rng is None:
            self.rng = self._initial("rng", torch.tensor([self.seed, 0], dtype=torch.int64, device=device))
            self.rng_step = torch.tensor([0, 1], dtype=torch.int64, device=device)  # made once: no copy per call

    def advance(self) -> None:
        """A drawing call's step: a new tensor, not an in-place one, so that a pending backward keeps
        its forward's."""
        with torch.no_grad():
            self.rng = self.rng + self.rng_step

    def starting_afresh(self, keys: list, forward: set[str]) -> tuple[list[str], list[str]]:
        """Of a graph's state ``keys``: the ``forward`` delayed-scaling slots it starts with no history,
        and (after a load) the slots that the loaded state has no entry for."""
        known = set(self._live()) | set(self.waiting)  # the step a graph before this one took too
        fresh = [key for key in keys if key in forward and key not in known]
        unloaded = [key for key in keys if isinstance(key, str) and key not in known] if self.loaded else []
        return fresh, unloaded

    def warn_of_unclaimed(self, plans: list[Plan], trained: bool) -> None:
        """Say which loaded entries no slot of ``plans`` can take: their slot was planned without
        delayed-scaling state (saved under another recipe), or names a module those graphs do not
        hold (saved from a model of other names), or, after a call that ``trained``, the
        stochastic-rounding step that no graph of it drew from; each would wait unused."""
        planned = {str(role): (role, quantizer) for plan in plans for role, quantizer in plan.slots}
        owners = {role.owner for role, _ in planned.values()}
        # A planned slot that keeps state and still waits did not take its entry only because its
        # graph failed first (a PlanError, which says why): not an entry that fits no slot.
        unclaimed = [
            key for key in self.waiting
            if (key in planned and not planned[key][1].keeps_state)
            or (key == "rng" and trained)
            or (key != "rng" and QuantizerRole.parse(key).owner not in owners)
        ]
        if unclaimed:
            user_stack.warn(
                f"graphquant: {len(unclaimed)} of the loaded state's entries fit no slot of the graphs of this model's first "
                f"call and wait unused ({', '.join(unclaimed[:3])}{', ...' if len(unclaimed) > 3 else ''}); its delayed-scaling "
                f"slots are {sorted(str(role) for role in self.delayed)[:3]}{' ...' if len(self.delayed) > 3 else ''}: "
                "was it saved from a model of other module names, or under another recipe? (A module only a later call runs, "
                "as a training-only head after an evaluation call, takes its entries then.)"
            )

    def _live(self) -> dict[str, torch.Tensor]:
        """The state of the slots planned so far, keyed as in ``state_dict``."""
        live = {str(role): tensor for role, tensor in self.delayed.items()}
        return live | ({"rng": self.rng} if self.rng is not None else {})

    def _initial(self, key: str, fresh: torch.Tensor, saved_scaling: Optional[str] = None) -> torch.Tensor:
        """A new slot's state: its loaded entry where ``load_state_dict`` kept one, else ``fresh``
        (a loaded entry that does not fit fails the call as a PlanError, not inside Dynamo's)."""
        loaded = self.waiting.pop(key, None)
        try:
            return fresh if loaded is None else self._restored(key, loaded, fresh, saved_scaling)
        except ValueError as error:
            raise PlanError(f"compiled.graphquant.load_state_dict: {error}") from None

    def _restored(self, key: str, value: torch.Tensor, like: torch.Tensor, scaling: Optional[str] = None) -> torch.Tensor:
        """A copy of the loaded ``value`` for the slot whose state looks like ``like``, on its device;
        ``scaling``: what the saved scale was computed for, where the checkpoint says."""
        if scaling is not None and scaling != self.scalings[key]:
            raise ValueError(
                f"graphquant state {key!r} holds a scale computed for {scaling}, but this model's slot computes "
                f"{self.scalings[key]}: its next step would quantize with a scale meant for another format. Compile "
                "with the recipe it was saved under, or load the state without this entry (its slot then starts afresh)"
            )
        if value.shape != like.shape or value.dtype != like.dtype:
            raise ValueError(
                f"graphquant state {key!r} is {value.dtype} of shape {tuple(value.shape)}, but this model keeps "
                f"{like.dtype} of shape {tuple(like.shape)} there (a delayed-scaling slot: [scale, amax_history...]; "
                "rng: [seed, step]): was it saved under another recipe?"
            )
        if key == "rng" and int(value[0]) != self.seed:
            raise ValueError(
                f"graphquant state 'rng' continues the stochastic-rounding streams of seed {int(value[0])}, but this "
                f"model was compiled with seed={self.seed}: compile with seed={int(value[0])} to resume that run"
            )
        _check_values(key, value)
        return value.to(device=like.device, copy=True)


def _checked_seed(seed: object) -> int:
    """graphquant.compile's ``seed`` as the int that the int64 [seed, step] state holds: a string
    or a float failed only at the first call that draws, inside Dynamo, and 1.5 drew as 1."""
    try:
        index = None if isinstance(seed, bool) else operator.index(seed)  # numpy's and torch's integers too
    except TypeError:
        index = None
    if index is None:
        raise TypeError(f"graphquant.compile: seed is an int (the stochastic-rounding seed), got {type(seed).__name__} {seed!r}")
    if not -(2**63) <= index < 2**63:
        raise ValueError(f"graphquant.compile: seed is an int64, from -2**63 to 2**63 - 1 (the stochastic-rounding state "
                         f"holds it as one), got {index}")
    return index


def _decoded(record: torch.Tensor):
    """A state_dict record (NUMBERS, SCALINGS) from its JSON's bytes."""
    return json.loads(bytes(record.tolist()))


def _check_values(key: str, value: torch.Tensor) -> None:
    """Refuse a loaded entry whose values no run makes: a delayed-scaling slot's scale (its first
    value, one an expert) finite and positive, its amax history nothing negative (an infinite or
    NaN amax may stand there, as an overflowing or NaN fp16 gradient leaves it, and the run goes on
    past it); rng's step not negative. The next call would quantize with them, some to NaN."""
    if key == "rng":
        if int(value[1]) < 0:
            raise ValueError(f"graphquant state 'rng' is [seed, step] with a step of 0 or more, got {value.tolist()}")
        return
    scale, history = value[..., 0], value[..., 1:]
    if not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise ValueError(
            f"graphquant state {key!r}: a delayed-scaling slot's scale (its first value, one an expert) is finite and "
            f"positive, got {scale.reshape(-1)[:4].tolist()}"
        )
    if bool((history < 0).any()):
        raise ValueError(f"graphquant state {key!r}: its amax history holds a negative amax")


def _softmax_output_role(role: QuantizerRole) -> bool:
    """Whether ``role`` is attention's s slot, which kept delayed-scaling state before P was scaled
    by its bound."""
    return role.module_type == "dpa" and role.tensor_type == "s"


def _names_a_role(key: str) -> bool:
    try:
        QuantizerRole.parse(key)
    except ValueError:
        return False
    return True
