"""Pass 2 (annotate): the plan, which quantizer each slot uses and how each GEMM of each site will run.

Plans are values: printing one gives a table, ``to_json`` a document. ``Planner`` builds them; it
calls the recipe's factory once per slot and keeps the answers, so a recompile (new shapes, new
dtype) re-uses them.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import json
from typing import Optional, Sequence

import torch
from tabulate import tabulate
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, statically_known_true

from graphquant import recipes, user_stack
from graphquant.formats import groups
from graphquant.formats.groups import GROUP_ROWS
from graphquant.kernels import backends
from graphquant.passes.find_gemms import LINEAR, TENSOR_TYPES, GemmSite
from graphquant.quantizers import (
    COLUMNWISE,
    ROWWISE,
    DelayedScalingRequest,
    IdentityQuantizer,
    Quantizer,
    mistyped_fields,
    parse_spec,
    quantizer_classes,
    undeclared_fields,
    unspecced_fields,
)
from graphquant.recipes import DEFAULT_FAST_ACCUMULATION, CustomRecipe
from graphquant.roles import QuantizerRole

# For CustomRecipe.small_gemms_in_high_precision: output features below the largest block of any
# format (FP8 block's 128), and a reduction below the smallest (NVFP4's 16), which no model
# quantizes for speed (a router's experts, a rotary embedding's outer product).
FEW_OUTPUTS = 128
SHORT_REDUCTION = 16

# (GEMM, operand a, operand b) with each operand as (tensor slot index, direction).
GEMMS = (
    ("fprop", (0, ROWWISE), (1, ROWWISE)),
    ("dgrad", (2, ROWWISE), (1, COLUMNWISE)),
    ("wgrad", (2, COLUMNWISE), (0, COLUMNWISE)),
)


ALL_GEMMS = frozenset(g[0] for g in GEMMS)


def gemms_run(site: GemmSite, training: bool) -> frozenset[str]:
    """The GEMMs a call of the site runs: fprop, and in training dgrad where x gets a gradient and
    wgrad where the weight does (GemmSite.gradients)."""
    return frozenset(g for g, runs in (("fprop", True), ("dgrad", training and site.gradients[0]), ("wgrad", training and site.gradients[1])) if runs)


def empty_dims(site: GemmSite) -> list[str]:
    """The names of the site's product dims that are 0 this call (m: no rows; batch: a batched
    product of no matrices), whose product the plan keeps in high precision with nothing to
    quantize and whose frozen weight no call reads."""
    batch, m, k = site.x_sizes
    # Known without a guard: a symbolic size that is 0 at every size (0 * s0, no rows whatever the batch) is empty too.
    return [name for name, size in (("batch", batch), ("m", m), ("n", site.w_sizes[1]), ("k", k)) if statically_known_true(size == 0)]


class PlanError(ValueError):
    """The recipe cannot run this model as asked; the message says where and what to change."""


class FactoryTypeError(PlanError, TypeError):
    """The recipe's factory returned something that is not a quantizer."""


# The start of the reason a GEMM with an empty dim (no rows this call) runs in high precision: its
# slots hold the identity for this call alone, not the recipe's formats, so graphquant.freeze
# takes a weight's format from another plan.
EMPTY_PRODUCT = "in high precision: it is empty"


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """One GEMM of one site: its operands' formats and how it runs."""

    site: str  # "layers.0.fc1#1": the owner's name (the roles' name) and which of its calls
    module_type: str
    gemm: str
    a: str  # "grad_output.rowwise"
    a_format: str
    b: str
    b_format: str
    bucket: str
    backend: backends.GemmBackend
    reason: str = ""
    # A grouped site's: the rows each expert's few tokens are padded to a multiple of
    # (backends.token_rows), which the rewrite carries as Site.token_rows; None elsewhere.
    token_rows: Optional[int] = None


# The GEMMs a call runs in forward (a linear's, an attention's); the others run in backward.
FORWARD_GEMMS = ("fprop", "qk", "pv")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every slot's quantizer and every GEMM's classification for one compiled graph."""

    device: str
    slots: tuple[tuple[QuantizerRole, Quantizer], ...]
    gemms: tuple[GemmPlan, ...]
    skipped: tuple[tuple[str, str], ...] = ()
    fast_accumulation: tuple[str, ...] = DEFAULT_FAST_ACCUMULATION  # the recipe's (CustomRecipe)
    # The calls ("name#call") that run in high precision although their roles' slots may hold the
    # recipe's formats, which another call of the same module runs: a product too small to tile
    # them, or empty this call (their GEMMs' reasons say which).
    high_precision_calls: tuple[str, ...] = ()

    def quantizer(self, role: QuantizerRole) -> Quantizer:
        return dict(self.slots)[role]

    def rows(self) -> list[list[str]]:
        return [
            [g.site, g.module_type, g.gemm, f"{g.a}: {g.a_format}", f"{g.b}: {g.b_format}", str(g.backend), g.bucket, g.reason]
            for g in self.gemms
        ]

    def summary(self) -> str:
        """One line: how many sites and GEMMs, how many of them fall in each bucket, and how many
        of the native ones the recipe keeps in high precision (a reader counting what is quantized
        would otherwise take them for low-precision GEMMs)."""
        buckets = collections.Counter(g.bucket for g in self.gemms)
        high = sum(g.backend.name == backends.HIGH_PRECISION for g in self.gemms)
        words = {backends.NATIVE: f" ({high} in high precision)" if high else ""}
        counts = ", ".join(f"{buckets[b]} {b}{words.get(b, '')}" for b in (backends.NATIVE, backends.EMULATED, backends.REJECTED) if buckets[b])
        sites = len({g.site for g in self.gemms})
        return f"graphquant plan on {self.device}: {sites} GEMM sites, {len(self.gemms)} GEMMs ({counts or 'none'})"

    def __str__(self) -> str:
        headers = ["site", "module_type", "gemm", "operand a", "operand b", "backend", "bucket", "why"]
        table = tabulate(self.rows(), headers=headers, tablefmt="simple")
        text = self.summary() + "\n\n" + "\n".join(line.rstrip() for line in table.splitlines())
        if self.skipped:
            text += "\n\nnot quantized:\n" + "\n".join(f"  {what}: {why}" for what, why in self.skipped)
        return text

    def to_json(self) -> str:
        return json.dumps(
            {
                "device": self.device,
                "slots": [{"role": dataclasses.asdict(r), "quantizer": q.spec} for r, q in self.slots],
                "gemms": [dataclasses.asdict(g) for g in self.gemms],
                "skipped": [{"node": what, "reason": why} for what, why in self.skipped],
                "fast_accumulation": list(self.fast_accumulation),
                "high_precision_calls": list(self.high_precision_calls),
            },
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """The plan ``to_json`` wrote (quantizers come back from their specs)."""
        doc = json.loads(text)
        missing = [key for key in ("device", "slots", "gemms", "skipped") if not isinstance(doc, dict) or key not in doc]
        if missing:
            raise ValueError(f"not the JSON of a graphquant plan (Plan.to_json, explain --json): it has no {', '.join(missing)}")
        return cls(
            device=doc["device"],
            slots=tuple((QuantizerRole(**s["role"]), parse_spec(s["quantizer"])) for s in doc["slots"]),
            gemms=tuple(GemmPlan(**{**g, "backend": backends.GemmBackend(**g["backend"])}) for g in doc["gemms"]),
            skipped=tuple((s["node"], s["reason"]) for s in doc["skipped"]),
            fast_accumulation=tuple(doc.get("fast_accumulation", DEFAULT_FAST_ACCUMULATION)),  # older dumps lack it
            high_precision_calls=tuple(doc.get("high_precision_calls", ())),
        )

    @classmethod
    def combine(cls, plans: Sequence["Plan"]) -> "Plan":
        """One plan for a model that compiled into several graphs (graph breaks), in graph order."""
        slots: dict[QuantizerRole, Quantizer] = {}
        for role, q in (slot for plan in plans for slot in plan.slots):
            if role not in slots or slots[role].high_precision:  # a graph whose calls of it all ran in high precision yields
                slots[role] = q
        return cls(
            device=plans[0].device,
            slots=tuple(slots.items()),
            gemms=tuple(g for plan in plans for g in plan.gemms),
            skipped=tuple(s for plan in plans for s in plan.skipped),
            fast_accumulation=plans[0].fast_accumulation,
            high_precision_calls=tuple(c for plan in plans for c in plan.high_precision_calls),
        )


def _meant_quantizer(answer: object) -> str:
    """What a factory that returned ``answer`` most likely meant to return, as advice ("" if unknown)."""
    if isinstance(answer, str):
        return f": to build one from its spec string, return graphquant.parse_spec({answer!r})"
    if isinstance(answer, type) and issubclass(answer, Quantizer):
        return f": return an instance, {answer.__name__}(...), not the class"
    if isinstance(answer, CustomRecipe):
        return ": it returned a whole recipe; pass that recipe to graphquant itself, not a factory that makes it"
    return ""


class Planner:
    """Asks the recipe's factory once per slot and turns GEMM sites into a validated Plan."""

    def __init__(self, recipe: CustomRecipe, *, strict: bool = False) -> None:
        self.recipe = recipes.require(recipe)
        self.strict = strict
        # graphquant.explain turns this off, so that rejected GEMMs (under strict, every emulated
        # one) stay in the plan with their reasons instead of failing the compile.
        self.fail_on_bucket = True
        self.factory_calls = 0
        self._quantizers: dict[QuantizerRole, Quantizer] = {}
        self._requests: dict[str, tuple[QuantizerRole, DelayedScalingRequest]] = {}  # by the module whose roles asked: the first

    def quantizer(self, role: QuantizerRole) -> Quantizer:
        """The slot's quantizer: the factory's answer for ``role``, checked, asked for only once."""
        if role not in self._quantizers:
            self._quantizers[role] = self._ask(role)
        return self._quantizers[role]

    def _ask(self, role: QuantizerRole) -> Quantizer:
        self.factory_calls += 1
        try:
            answer = self.recipe.qfactory(role)
        except Exception as error:
            raise PlanError(f"the recipe's factory raised for role {role}: {type(error).__name__}: {error}") from error
        if answer is None:
            raise PlanError(
                f"the recipe's factory returned None for role {role}; return IdentityQuantizer() to keep "
                "this slot in high precision, and end the factory with a default for every other role"
            )
        if isinstance(answer, DelayedScalingRequest):
            owner = role.owner
            first, earlier = self._requests.setdefault(owner, (role, answer))
            if answer != earlier:
                field = next(f.name for f in dataclasses.fields(answer) if getattr(answer, f.name) != getattr(earlier, f.name))
                raise PlanError(
                    f"the factory returned DelayedScalingRequests of different {field} for roles {first} "
                    f"({getattr(earlier, field)!r}) and {role} ({getattr(answer, field)!r}) of module {owner!r}; the "
                    "requests for one module's roles must be equal (TransformerEngine keeps one recipe state a module)"
                )
            return answer.resolve(role.backward)
        if not isinstance(answer, Quantizer):
            raise FactoryTypeError(
                f"the recipe's factory returned a {type(answer).__name__} for role {role}; it must return a "
                f"graphquant Quantizer (or a DelayedScalingRequest){_meant_quantizer(answer)}"
            )
        undeclared = undeclared_fields(answer)
        if undeclared:
            raise FactoryTypeError(
                f"the recipe's factory returned {type(answer).__name__} for role {role}, whose attributes "
                f"({', '.join(undeclared)}) are not dataclass fields, so its spec ({answer.spec}) does not hold them: decorate "
                "the class with @dataclasses.dataclass(frozen=True) and declare them as fields"
            )
        mistyped = mistyped_fields(answer)
        if mistyped:
            raise FactoryTypeError(
                f"the recipe's factory returned {type(answer).__name__} for role {role} whose {'; '.join(mistyped)} "
                "(graphquant's quantizers take no device, TransformerEngine's second argument: pass options by keyword)"
            )
        unspecced = unspecced_fields(answer)
        if unspecced:
            raise FactoryTypeError(
                f"the recipe's factory returned {type(answer).__name__} for role {role} whose {'; '.join(unspecced)}: the "
                "compiled graph rebuilds each quantizer from its spec, so its fields hold values a spec gives back (bools, "
                "ints, floats, strings, tuples of them, quantizers, torch dtypes)"
            )
        return answer

    def plan(self, sites: Sequence[GemmSite], device: torch.device, *, training: bool, skipped=(), attention=()) -> Plan:
        """The plan of GEMM ``sites`` and of ``attention`` sites (passes.find_attention.DpaSite)."""
        slots: dict[QuantizerRole, Quantizer] = {}
        gemms = []
        operand_quantizers: set[Quantizer] = set()
        high_precision_calls = []
        for site in sites:
            roles = site.roles()
            quantizers = [self.quantizer(role) for role in roles]
            untileable = self._untileable(site, quantizers, training)
            if untileable:
                operand_quantizers.update(quantizers)  # the factory's answers: it did ask to quantize
                high_precision_calls.append(site.label)
                quantizers = [IdentityQuantizer()] * len(roles)
                for role in roles:  # this call's alone: another call of the module may run the recipe's formats
                    slots.setdefault(role, quantizers[0])
            else:
                slots.update(zip(roles, quantizers))
            self._check_grouped(site, quantizers)
            batch = site.x_shape[0]
            _, m, k = site.x_sizes
            n = site.w_sizes[1]
            dims = {"fprop": (m, n, k), "dgrad": (m, k, n), "wgrad": (n, k, m)}
            token_rows = self._token_rows(site, quantizers[0], training) if site.module_type == "grouped_linear" else None
            runs = gemms_run(site, training)
            for gemm, (ia, da), (ib, db) in (g for g in GEMMS if g[0] in runs):
                qa, qb = quantizers[ia].child(da), quantizers[ib].child(db)
                operand_quantizers.update((qa, qb))
                fast = gemm in self.recipe.fast_accumulation
                if site.module_type == "grouped_linear":
                    block = groups.token_block(token_rows, site.x_sizes[1], site.w_sizes[0])
                    selection = backends.select_grouped(qa, da, qb, db, device, k, fast, self._token_tiles(site, block), block)
                else:
                    quantize_a = site.runs_inference_product(not training)
                    selection = backends.select_symbolic(qa, da, qb, db, device, dims[gemm], batch, fast, quantize_a)
                if untileable:
                    selection = dataclasses.replace(selection, reason=untileable)
                if self.strict and selection.bucket == backends.EMULATED:
                    # The backend stays the one it would run on, which graphquant.explain runs.
                    selection = backends.Selection(
                        backends.REJECTED,
                        selection.backend,
                        f"strict=True rejects emulated GEMMs ({selection.reason}); give this GEMM a pair with a "
                        f"native GEMM on {device.type}, or compile without strict"
                        if backends.capability(device) is not None else
                        f"strict=True rejects emulated GEMMs, and {device.type} runs every low-precision GEMM emulated: "
                        "compile without strict, or on a GPU with native GEMMs (Hopper: FP8)",
                    )
                a = (f"{roles[ia].tensor_type}.{da}", quantizers[ia].direction_spec(da))
                b = (f"{roles[ib].tensor_type}.{db}" + (" (frozen)" if site.weight_frozen else ""), quantizers[ib].direction_spec(db))
                gemms.append(self._entry(site, gemm, a, b, selection, token_rows))
        for site in attention:
            gemms.extend(self._plan_attention(site, slots, device, training))
        plan = Plan(
            device=str(device),
            slots=tuple(slots.items()),
            gemms=tuple(gemms),
            skipped=tuple(skipped),
            fast_accumulation=self.recipe.fast_accumulation,
            high_precision_calls=tuple(high_precision_calls),
        )
        if gemms and not attention and all(q.high_precision for q in operand_quantizers):
            user_stack.warn(
                f"the recipe quantizes no GEMM of this graph: every operand of its {len(gemms)} GEMMs is "
                "IdentityQuantizer (high precision); check the conditions in the recipe's factory (module_type, "
                "tensor_type, name); graphquant.explain(model, recipe, *inputs) prints what each slot got"
            )
        return plan

    @staticmethod
    def _token_rows(site: GemmSite, x_quantizer: Quantizer, training: bool) -> int:
        """The rows a grouped site pads each expert's few tokens to a multiple of: few where it runs
        fprop alone (an inference graph's site, or a stack graphquant.freeze stored) and x's format
        allows it (backends.token_rows)."""
        return backends.token_rows(x_quantizer, site.runs_inference_product(not training) or site.stored_stack)

    @staticmethod
    def _token_tiles(site: GemmSite, block: int) -> bool:
        """Whether a grouped site's tokens are tiles of few tokens an expert (NativeGemm.token_tiles):
        in groups of FEW_TOKEN_ROWS (``block``: groups.token_block of its tokens) and more than a
        decode step's one token a program."""
        decoding = backends.triton_decode
        few = block == groups.FEW_TOKEN_ROWS
        return few and decoding is not None and not decoding.one_token_a_program(site.x_sizes[1], site.w_sizes[0])

    def _plan_attention(self, site, slots: dict, device: torch.device, training: bool) -> list[GemmPlan]:
        """An attention site's slots, checked as TE checks DotProductAttention's, and its products."""
        roles = site.roles()
        for role in roles:
            slots[role] = self.quantizer(role)
        for role in dict.fromkeys(roles):
            self._check_attention_quantizer(site, role, slots[role])
        try:
            slots[site.role("s")] = backends.softmax_output_format(slots[site.role("s")])
        except ValueError as error:
            raise PlanError(f"{site.label} (dpa) s: {error}") from None
        tensors = site.tensors()
        quantizers = {t: slots[site.role(slot)] for t, (slot, _, _) in tensors.items()}
        used: dict[str, set[str]] = {}
        for _, *operands in site.products(training):
            for tensor, direction in operands:
                used.setdefault(tensor, set()).add(direction)
        for tensor, directions in used.items():
            slot, batch, shape = tensors[tensor]
            for direction in sorted(directions, reverse=True):
                try:
                    self._check_tiling(quantizers[tensor], direction, batch, shape)
                except ValueError:
                    # Once more on this call's sizes, so that the message names them (int() of a
                    # symbolic size keeps the failing graph to them alone).
                    try:
                        self._check_tiling(quantizers[tensor], direction, int(batch), (int(shape[0]), int(shape[1])))
                    except ValueError as error:
                        lengths = (f"query length {int(site.q_sizes[2])}, key length {int(site.k_sizes[2])}, head dims "
                                   f"{int(site.q_sizes[3])} and {int(site.v_sizes[3])}")
                        raise PlanError(
                            f"{site.label} (dpa) {tensor} ({slot}): {error}. This attention's {lengths}: a block format "
                            "needs them whole blocks (a KV cache that grows a token a step does not stay so; per-tensor FP8 "
                            "takes any)"
                        ) from None
                    raise
        operand = lambda t, d: (f"{t}: {tensors[t][0]}.{d}", quantizers[t].direction_spec(d))  # noqa: E731
        head_dims = (int(site.q_sizes[3]), int(site.v_sizes[3]))
        entries = []
        for gemm, a, b in site.products(training):
            backward = gemm not in FORWARD_GEMMS
            selection = backends.select_attention(
                device, quantizers["Q"], quantizers["P"], head_dims, site.masked, backward, quantizers["dO"], quantizers["dS"],
                query_length=site.q_sizes[2], key_length=site.k_sizes[2],
            )
            if self.strict and selection.bucket == backends.EMULATED:
                selection = backends.Selection(
                    backends.REJECTED,
                    selection.backend,
                    f"strict=True rejects emulated attention ({selection.reason}); compile without strict",
                )
            entries.append(self._entry(site, gemm, operand(*a), operand(*b), selection))
        return entries

    @staticmethod
    def _check_attention_quantizer(site, role: QuantizerRole, quantizer: Quantizer) -> None:
        """TE's rule for every dpa slot, hint-only ones included: per-tensor FP8 (current or delayed
        scaling) or MXFP8; never NVFP4."""
        if quantizer.attention_format:
            return
        what = role.tensor_type or role.name
        nvfp4 = " (attention takes no NVFP4)" if "nvfp4" in quantizer.spec else ""
        raise PlanError(
            f"{site.label} (dpa) {what}: the factory gave {quantizer}{nvfp4}, but FP8 attention quantizes every dpa "
            f"role, the hint-only {site.name}.dpa_output and {site.name}.dpa_grad_input included, with "
            f"{' or '.join(cls.__name__ for cls in quantizer_classes() if cls.attention_format)} (or a DelayedScalingRequest); return one "
            "for module_type 'dpa' and those names, or build the recipe with fp8_dpa=False to keep attention in "
            "high precision"
        )

    def _entry(
        self, site, gemm: str, a: tuple[str, str], b: tuple[str, str], selection: backends.Selection, token_rows: Optional[int] = None
    ) -> GemmPlan:
        """The plan of one product of ``site``, each operand as (what it is, its format); a
        rejected one fails the compile (unless explaining)."""
        entry = GemmPlan(site.label, site.module_type, gemm, *a, *b, selection.bucket, selection.backend, selection.reason, token_rows)
        self._check_bucket(entry)
        return entry

    def _check_bucket(self, g: GemmPlan) -> None:
        if self.fail_on_bucket and g.bucket == backends.REJECTED:
            raise PlanError(f"{g.site} ({g.module_type}) {g.gemm}: {g.a} is {g.a_format} and {g.b} is {g.b_format}: rejected: {g.reason}")

    def keeps_linear_in_high_precision(self, name: str, weight_shape: tuple[int, int]) -> bool:
        """Whether an inference plan would keep linear ``name`` of that weight in high precision for
        its shape alone (a router's few outputs, a short reduction), on a whole tile of rows: what
        graphquant.freeze asks of a linear no graph has run yet, so that its stored format is the
        one the first call's plan runs."""
        n, k = weight_shape
        site = GemmSite(form=LINEAR, module_type="linear", name=name, call=0, batched=False, x_shape=(1, 128, k),
                        w_shape=(1, n, k), x_sizes=(1, 128, k), w_sizes=(1, n, k))
        try:
            return bool(self._untileable(site, [self.quantizer(role) for role in site.roles()], training=False))
        except PlanError:
            return False  # not its shape alone: the weight does not tile (graphquant.freeze says so)

    def _untileable(self, site: GemmSite, quantizers: list[Quantizer], training: bool) -> str:
        """Why the site runs in high precision although the factory quantized it ("" if it does
        not): only its few output features or its short reduction keep it from tiling the
        formats' blocks and the recipe keeps such sites in high precision
        (CustomRecipe.small_gemms_in_high_precision), in inference too where its training formats
        would (the same precision in every mode); any other shape that does not tile is the
        error it was. An empty product (a dim of 0: no rows this call) has nothing to quantize."""
        empty = empty_dims(site)
        if empty:
            return f"{EMPTY_PRODUCT} ({', '.join(f'{name} = 0' for name in empty)}), nothing to quantize"
        formats = ", ".join(dict.fromkeys(q.spec for q in quantizers))
        try:
            self._check_shapes(site, quantizers, gemms_run(site, training))
        except PlanError:
            # Whether it is a small site is a matter of its shape, not of which gradients this call
            # takes: a router stays in high precision whether or not its input gets a gradient.
            runs = ALL_GEMMS if training else gemms_run(site, training)
            small = self._small_dims(site, quantizers, runs) if self.recipe.small_gemms_in_high_precision else ""
            if not small:
                raise
            return f"in high precision: its {small} tile no block of the recipe's formats ({formats})"
        # The GEMMs this call runs may tile a router that all of them do not (rowwise blocks alone
        # in evaluation; no dgrad where its input takes no gradient, a frozen backbone's): quantized
        # there it would route otherwise than where its input takes a gradient. Checked on whole
        # rows (128), so that the token count takes no guard: its weight's dims decide.
        n, k = site.w_sizes[1], site.w_sizes[2]
        few = bool(n < FEW_OUTPUTS) or bool(k < SHORT_REDUCTION)  # dynamic dims as guards, as _small_dims tests them
        if few and self.recipe.small_gemms_in_high_precision:
            whole_rows = dataclasses.replace(site, x_sizes=(site.x_sizes[0], 128, site.x_sizes[2]))
            try:
                self._check_shapes(whole_rows, quantizers, ALL_GEMMS)
            except PlanError:
                small = self._small_dims(whole_rows, quantizers, ALL_GEMMS)
                if small:
                    where = "where its input takes a gradient" if training else "in training"
                    return f"in high precision, as {where}: its {small} tile no block of the recipe's formats ({formats}) there"
        return ""

    def _small_dims(self, site: GemmSite, quantizers: list[Quantizer], runs: frozenset[str]) -> str:
        """The site's few output features (below FEW_OUTPUTS) and short reduction (below
        SHORT_REDUCTION), as words, where they keep it from tiling (with 128 of each it would tile
        every format), its rows too where they also do not (an MoE router of any token count: the
        site stays small, so cheap in high precision); "" otherwise, rows that alone keep it from
        tiling included (the error any site's would be)."""
        batch, n, k = site.w_sizes
        # A dynamic size is tested too: the test becomes a guard, so a size past the bound recompiles.
        small = {"n": bool(n < FEW_OUTPUTS), "k": bool(k < SHORT_REDUCTION)}
        if not any(small.values()):
            return ""
        widened = (batch, 128 if small["n"] else n, 128 if small["k"] else k)
        x_batch, m, _ = site.x_sizes

        def tiles(rows: object, w_sizes: tuple = widened) -> bool:
            try:
                self._check_shapes(dataclasses.replace(site, w_sizes=w_sizes, x_sizes=(x_batch, rows, w_sizes[2])), quantizers, runs)
            except (PlanError, ValueError):
                return False
            return True

        rows = tiles(m)
        if not rows and not tiles(-(-m // 128) * 128):  # a dynamic count too: its multiple of 128 is one for any count
            return ""
        if not rows and tiles(-(-m // 128) * 128, site.w_sizes):  # its rows alone keep it from tiling, as any site's would
            return ""
        words = [f"{n} output features" if small["n"] else "", f"{k}-long reduction" if small["k"] else "", "" if rows else f"{m} rows"]
        return " and ".join(w for w in words if w)

    def _check_shapes(self, site: GemmSite, quantizers: list[Quantizer], runs: frozenset[str]) -> None:
        """Each tensor the site quantizes must tile the block of every direction a GEMM that
        ``runs`` makes it in (a frozen weight's transpose, which no wgrad reads, need not).

        Dynamic sizes are checked as symbols: each test on one becomes a guard of the compiled
        graph, so a later size that fails it recompiles the graph and fails here.
        """
        batch, m, k = site.x_sizes
        _, n, _ = site.w_sizes
        shapes = shown = ((batch * m, k), (batch * n, k), (batch * m, n))
        if site.module_type == "grouped_linear":  # the op pads every group's rows, and grad_output's columns
            shapes = ((GROUP_ROWS, k), (GROUP_ROWS, k), (GROUP_ROWS, GROUP_ROWS))
        made = {(tensor, direction) for gemm, *operands in GEMMS if gemm in runs for tensor, direction in operands}
        for index, (role_type, quantizer, shape, told) in enumerate(zip(TENSOR_TYPES[site.module_type], quantizers, shapes, shown)):
            directions = [d for d in (ROWWISE, COLUMNWISE) if (index, d) in made]
            for direction in directions:
                try:
                    self._check_tiling(quantizer, direction, batch, shape)
                except GuardOnDataDependentSymNode:
                    rows, cols = quantizer.child(direction).block(direction)
                    raise PlanError(
                        f"{site.label} ({site.module_type}) {role_type}: {quantizer} makes its {direction} representation in "
                        f"{rows}x{cols} blocks, but the {shape[0]}x{shape[1]} tensor's size is chosen at run time by a "
                        "data-dependent op (torch.where, nonzero or a boolean index, which Dynamo keeps in the graph under "
                        "capture_dynamic_output_shape_ops), so no check that it tiles can be made. Pad each such group of rows "
                        "to a multiple of the block in the model (as (n + b - 1) // b * b, which the symbolic shapes can "
                        "prove a multiple), run the experts through torch._grouped_mm (graphquant pads its groups inside the "
                        "op), or have the recipe's factory return IdentityQuantizer() for the input and grad_output roles of "
                        f"every such linear (this one: {site.name!r})"
                    ) from None
                except ValueError:
                    # Once more on this call's sizes, so that the message names them (a grouped
                    # site's as the model has them, not as the op pads them, where they fail the
                    # same way); int() also keeps the failing graph to these sizes alone.
                    try:
                        for sizes in (told, shape):
                            self._check_tiling(quantizer, direction, int(batch), (int(sizes[0]), int(sizes[1])))
                    except ValueError as error:
                        rows = int(shape[0])
                        tokens = site.module_type == "linear" and int(batch) == 1 and role_type != "weight" and self.tiles(
                            quantizer, direction, 1, (-(-rows // 128) * 128, int(shape[1]))
                        )
                        remedy = (
                            f"Its {rows} row{'s are' if rows != 1 else ' is'} this call's tokens: give the "
                            "model a token count that tiles (pad the batch), or have the recipe's factory return "
                            "IdentityQuantizer() for the input and grad_output roles of every linear they reach"
                            if tokens else
                            "To keep this GEMM in high precision, have the recipe's factory return IdentityQuantizer() for "
                            f"roles named {site.name!r}" + (" (the compiled model's own)" if not site.name else "")
                        )
                        raise PlanError(f"{site.label} ({site.module_type}) {role_type}: {error}. {remedy}") from None
                    raise

    @classmethod
    def tiles(cls, quantizer: Quantizer, direction: str, batch: int, shape: tuple[int, int]) -> bool:
        """Whether ``quantizer`` tiles ``shape`` in ``direction`` (graphquant.freeze asks it too)."""
        try:
            cls._check_tiling(quantizer, direction, batch, shape)
        except ValueError:
            return False
        return True

    @staticmethod
    def _check_tiling(quantizer: Quantizer, direction: str, batch: int, shape: tuple[int, int]) -> None:
        """The format's own shape rule, and blocks along the rows of a batched operand must not
        straddle two batch entries."""
        quantizer.check_shape(shape, direction)
        block_rows = quantizer.child(direction).block(direction)[0]
        if block_rows > 1 and batch > 1 and (shape[0] // batch) % block_rows:
            raise ValueError(
                f"{quantizer}: {direction} blocks span {block_rows} rows but each of the {batch} batch entries "
                f"has {shape[0] // batch} rows; use a row count per entry that is a multiple of {block_rows}"
            )

    @staticmethod
    def _check_grouped(site: GemmSite, quantizers: list[Quantizer]) -> None:
        """A grouped site runs only the formats a grouped GEMM takes (backends.grouped_unsupported)."""
        if site.module_type != "grouped_linear":
            return
        for role_type, quantizer in zip(TENSOR_TYPES[site.module_type], quantizers):
            reason = backends.grouped_unsupported(quantizer)
            if reason:
                raise PlanError(f"{site.label} ({site.module_type}) {role_type}: {reason}")

    def warn_of_unmatched_names(self, plan: Plan) -> None:
        """A name filter that matches nothing fails silently inside the factory; say so here, of
        the plan of every graph a model's call compiled (a graph break's graphs each hold some)."""
        names = sorted({role.name for role, _ in plan.slots})
        for expected in self.recipe.expected_names:
            if not any(name == expected or name.startswith(expected + ".") for name in names):
                close = " or ".join(map(repr, difflib.get_close_matches(expected, names, n=3)))
                listed = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
                user_stack.warn(
                    f"the recipe expects a module named {expected!r}, but no GEMM of the compiled model belongs to "
                    f"it{f'; did you mean {close}?' if close else ''} (its GEMMs belong to: {listed or 'none'})"
                )
