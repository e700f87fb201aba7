"""graphquant's modules import one way, as the data flows (design.md, "Layout").

Layers, from the one users import down to the numerics. A module imports modules of its own
layer and of the layers below it, never of a layer above:

    face        graphquant (the package), compiler, run_state (what a run keeps from call to call),
                explainer, numerics_report, dump, __main__
    passes      graphquant.passes: find GEMMs, plan, rewrite, the saturating cast
    ops         graphquant.ops: the custom ops and the autograd formulas that compose them
    recipes     roles, recipes, factories, zoo (what a recipe says: data), user_stack (warnings
                pointed at the user's line)
    kernels     graphquant.kernels: native and Triton kernels, GEMM backends, emulation; graphquant._C
    quantizers  graphquant.quantizers (each format's home), distributed (the amax all-reduce a
                quantize may run)
    formats     graphquant.formats: the reference numerics, plain torch, no ops

Within passes, only the passes that convert the graph (rewrite, and gemms_sharing_x, which merges
rewritten calls) import the op layer: the passes that annotate (find_gemms, plan) decide from the
graph, the quantizers and the GEMM backends alone.

Every import counts: at module level, inside functions, under TYPE_CHECKING. A new module must be
given a layer here.
"""

from __future__ import annotations

import ast
import os
from typing import Iterator, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Source folders and the package each one is importable as (passes/ is graphquant.passes).
SOURCES = {"graphquant": "graphquant", "passes": "graphquant.passes"}

LAYERS = (
    ("face", ("graphquant", "graphquant.compiler", "graphquant.run_state", "graphquant.explainer", "graphquant.numerics_report", "graphquant.dump", "graphquant.freezing",
              "graphquant.eager_products", "graphquant.model_methods", "graphquant.__main__")),
    ("passes", ("graphquant.passes",)),
    ("ops", ("graphquant.ops",)),
    ("recipes", ("graphquant.roles", "graphquant.recipes", "graphquant.factories", "graphquant.zoo", "graphquant.user_stack")),
    ("kernels", ("graphquant.kernels", "graphquant._C")),
    ("quantizers", ("graphquant.quantizers", "graphquant.distributed")),
    ("formats", ("graphquant.formats",)),
)
RANK = {name: len(LAYERS) - i for i, (name, _) in enumerate(LAYERS)}  # higher: nearer the user
CONVERTING_PASSES = ("graphquant.passes.rewrite", "graphquant.passes.gemms_sharing_x")
_CONVERTERS = " and ".join(CONVERTING_PASSES)


def layer_of(module: str) -> Optional[str]:
    """The layer of ``module`` (a package's layer covers its submodules; the bare package
    ``graphquant`` is the face alone), or None where none is given."""
    best: tuple[int, Optional[str]] = (-1, None)
    for layer, prefixes in LAYERS:
        for prefix in prefixes:
            covers = module == prefix or (prefix != "graphquant" and module.startswith(prefix + "."))
            if covers and len(prefix) > best[0]:
                best = (len(prefix), layer)
    return best[1]


def source_modules(root: str = ROOT) -> dict[str, str]:
    """Every module of the package, by name, with its file relative to ``root``."""
    modules = {}
    for folder, package in SOURCES.items():
        for directory, subdirs, files in os.walk(os.path.join(root, folder)):
            # graphquant/passes may be a link to passes/, which is walked as itself
            subdirs[:] = sorted(d for d in subdirs if d != "__pycache__" and not os.path.islink(os.path.join(directory, d)))
            for name in sorted(f for f in files if f.endswith(".py")):
                parts = os.path.relpath(os.path.join(directory, name[: -len(".py")]), os.path.join(root, folder)).split(os.sep)
                parts = [p for p in parts if p != "."]
                if parts and parts[-1] == "__init__":
                    parts.pop()
                modules[".".join([package, *parts])] = os.path.relpath(os.path.join(directory, name), root)
    return modules


def imported_modules(source: str, module: str, is_package: bool, known: set[str]) -> Iterator[str]:
    """The graphquant modules that ``source`` (the text of ``module``) imports anywhere in it:
    for ``from P import n``, P.n where that is a module, else P."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        yield from (name for name in names if name == "graphquant" or name.startswith("graphquant."))


def violations(root: str = ROOT) -> list[str]:
    """Each import against the flow, as "file imports module: the rule it breaks"."""
    modules = source_modules(root)
    known = set(modules) | {"graphquant._C"}
    found = []
    for module, path in sorted(modules.items()):
        importer = layer_of(module)
        with open(os.path.join(root, path)) as f:
            targets = set(imported_modules(f.read(), module, path.endswith("__init__.py"), known))
        for target in sorted(targets):
            layer = layer_of(target)
            if importer is None or layer is None:
                continue  # test_every_module_has_a_layer names it
            if RANK[layer] > RANK[importer]:
                found.append(f"{path} imports {target}: {layer} is above {importer}")
            elif importer == "passes" and module not in CONVERTING_PASSES and layer == "ops":
                found.append(f"{path} imports {target}: a pass that annotates imports no ops (only {_CONVERTERS} convert)")
    return found


def test_every_module_has_a_layer():
    unplaced = [f"{path} ({module})" for module, path in sorted(source_modules().items()) if layer_of(module) is None]
    assert not unplaced, "give these modules a layer in tests/test_layout.py: " + ", ".join(unplaced)


def test_imports_run_one_way():
    found = violations()
    assert not found, f"{len(found)} imports against the flow (tests/test_layout.py says why):\n" + "\n".join(found)


def test_an_import_against_the_flow_is_found_inside_a_function(tmp_path):
    """The rule covers imports a function makes when it runs, and names file, module and rule."""
    (tmp_path / "passes").mkdir()
    (tmp_path / "passes" / "find_gemms.py").write_text("import torch\n")
    formats = tmp_path / "graphquant" / "formats"
    formats.mkdir(parents=True)
    (formats / "__init__.py").write_text("")
    (formats / "late.py").write_text("def scales():\n    from graphquant.ops import registry\n")
    (tmp_path / "passes" / "plan.py").write_text("from ..ops.grouped import unsupported\n")
    assert violations(str(tmp_path)) == [
        f"{os.path.join('graphquant', 'formats', 'late.py')} imports graphquant.ops: ops is above formats",
        f"{os.path.join('passes', 'plan.py')} imports graphquant.ops.grouped: a pass that annotates imports no ops "
        f"(only {_CONVERTERS} convert)",
    ]
