"""Every name the tests and benchmarks take from graphquant's modules, or from their sibling
modules, still exists there, and every call of such a module's function passes arguments it
takes: read from the sources, not by importing or running them.

GPU tests skip on CI's CPU machines and benchmarks run only on a GPU, so a name renamed or removed
in the library (a kernel module's helper, a benchmark's constant) would break them unseen until
a GPU session spends its time finding out. Each ``module.name`` (through ``import`` aliases, ``from
package import module`` and module aliases assigned at top level, such as ``KERNELS =
backends.triton_grouped_fp8``) and each ``from module import name`` is checked against the names
the module's source binds at its top level (definitions, assignments, imports; a module with a
``__getattr__`` of its own is taken as having any name). A call ``module.function(...)`` of a
function the module defines undecorated (or only cached) is checked for keywords it has no
parameter of and more positional arguments than it takes; so is each call of a function of the
CUDA extension (graphquant._C, which CI never builds) against the arguments its pybind11
definition names."""

from __future__ import annotations

import ast
import functools
import pathlib
import re
from typing import Optional

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"graphquant": ROOT / "graphquant", "graphquant.passes": ROOT / "passes"}
CHECKED = sorted([*ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/*.py"), *ROOT.glob("examples/*.py")])
LIBRARY = sorted([*ROOT.glob("graphquant/**/*.py"), *ROOT.glob("passes/*.py"), *CHECKED])  # where the extension is called
MODULE_ATTRIBUTES = ("__file__", "__name__", "__doc__", "__dict__", "__path__", "__spec__", "__package__", "__loader__")


@functools.lru_cache(maxsize=None)
def tree_of(path: pathlib.Path) -> ast.Module:
    """``path``'s source parsed (once: most files are read for several others)."""
    return ast.parse(path.read_text(), str(path))


def module_path(name: str, near: Optional[pathlib.Path] = None) -> Optional[pathlib.Path]:
    """The source of module ``name``: graphquant's (passes/ as graphquant.passes), or a sibling of
    the file ``near`` (benchmarks import each other by their bare names, as tests do)."""
    for package, folder in sorted(PACKAGES.items(), key=lambda item: -len(item[0])):
        if name == package or name.startswith(package + "."):
            path = folder.joinpath(*name[len(package) + 1 :].split(".")) if name != package else folder
            if path.is_dir():
                return path / "__init__.py"
            return path.with_suffix(".py") if path.with_suffix(".py").exists() else None
    if near is not None and "." not in name and (near.parent / f"{name}.py").exists():
        return near.parent / f"{name}.py"
    return None


@functools.lru_cache(maxsize=None)
def top_level(path: pathlib.Path) -> tuple[dict[str, Optional[pathlib.Path]], bool]:
    """({name: the module it is bound to, where it is one we can read, else None} for every name
    ``path``'s source binds at its top level, whether it has a module ``__getattr__``)."""
    tree = tree_of(path)
    names: dict[str, Optional[pathlib.Path]] = dict.fromkeys(MODULE_ATTRIBUTES)
    if path.name == "__init__.py":  # a package's submodules are its attributes once imported
        names.update({p.stem: p for p in path.parent.glob("*.py") if p.stem != "__init__"})
        names.update({p.name: p / "__init__.py" for p in path.parent.iterdir() if (p / "__init__.py").exists()})

    def bind(target: ast.AST, value: Optional[pathlib.Path] = None) -> None:
        if isinstance(target, ast.Name):  # a module bound on one path (an import, or None where it fails) stays known
            names[target.id] = value or names.get(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                bind(element)
        elif isinstance(target, ast.Starred):
            bind(target.value)

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] = None
            elif isinstance(node, ast.Assign):
                value = resolved(node.value, path, names)
                for target in node.targets:
                    bind(target, value)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                bind(node.target)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update(imported(node, path))
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for block in ("body", "orelse", "finalbody"):
                    visit(getattr(node, block, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
    visit(tree.body)
    return names, "__getattr__" in names


def imported(node: ast.Import | ast.ImportFrom, path: pathlib.Path) -> dict[str, Optional[pathlib.Path]]:
    """The names an import statement in ``path`` binds, each to its module where it is one we can
    read (graphquant imports nothing relatively, so a relative import's names stay unknown)."""
    if isinstance(node, ast.Import):
        return {alias.asname or alias.name.split(".")[0]: module_path(alias.name if alias.asname else alias.name.split(".")[0], path)
                for alias in node.names}
    return {alias.asname or alias.name: None if node.level else module_path(f"{node.module}.{alias.name}", path)
            for alias in node.names if alias.name != "*"}


def resolved(expr: ast.AST, path: pathlib.Path, names: dict[str, Optional[pathlib.Path]]) -> Optional[pathlib.Path]:
    """The module ``expr`` (a name or a chain of attributes) stands for in ``path``, where known."""
    if isinstance(expr, ast.Name):
        return names.get(expr.id)
    if isinstance(expr, ast.IfExp):  # a module where its import can run, else None
        return resolved(expr.body, path, names) or resolved(expr.orelse, path, names)
    if (isinstance(expr, ast.Call) and ast.unparse(expr.func) == "importlib.import_module" and expr.args
            and isinstance(expr.args[0], ast.Constant) and isinstance(expr.args[0].value, str)):
        return module_path(expr.args[0].value, path)
    if isinstance(expr, ast.Attribute):
        module = resolved(expr.value, path, names)
        if module is not None:
            bound, _ = top_level(module)
            return bound.get(expr.attr)
    return None


@functools.lru_cache(maxsize=None)
def signatures(path: pathlib.Path) -> dict[str, ast.arguments]:
    """The parameters of each function ``path``'s source defines at its top level, undecorated or
    only cached (a decorator may give a function other parameters)."""
    tree = tree_of(path)
    plain = ("functools.lru_cache", "functools.cache", "lru_cache", "cache")
    return {node.name: node.args for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and all(ast.unparse(d.func if isinstance(d, ast.Call) else d) in plain for d in node.decorator_list)}


def wrong_arguments(call: ast.Call, parameters: ast.arguments) -> list[str]:
    """What of ``call``'s arguments a function of ``parameters`` would refuse."""
    named = {a.arg for a in (*parameters.args, *parameters.kwonlyargs)}
    wrong = [f"no parameter {k.arg}" for k in call.keywords if k.arg is not None and k.arg not in named and parameters.kwarg is None]
    positional = len(parameters.posonlyargs) + len(parameters.args)
    if parameters.vararg is None and not any(isinstance(a, ast.Starred) for a in call.args) and len(call.args) > positional:
        wrong.append(f"{len(call.args)} positional arguments, it takes {positional}")
    return wrong


def stale_references(path: pathlib.Path) -> list[str]:
    """``path``'s references to names its modules do not bind, and its calls of their functions
    with arguments those do not take, each as "line: what"."""
    tree = tree_of(path)
    names = dict(top_level(path)[0])
    for node in ast.walk(tree):  # a test's imports inside its functions (GPU tests import their kernels there)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({name: module for name, module in imported(node, path).items() if module is not None})
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            module = module_path(node.module, path)
            if module is not None:
                bound, dynamic = top_level(module)
                found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                          if a.name != "*" and a.name not in bound and not dynamic]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            module = resolved(node.func.value, path, names)
            parameters = signatures(module).get(node.func.attr) if module is not None else None
            if parameters is not None:
                found += [f"{node.lineno}: {ast.unparse(node.func)}(...): {w}" for w in wrong_arguments(node, parameters)]
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            module = resolved(node.value, path, names)
            if module is not None:
                bound, dynamic = top_level(module)
                if node.attr not in bound and not dynamic:
                    found.append(f"{node.lineno}: {ast.unparse(node)} ({module.relative_to(ROOT)} binds no {node.attr})")
    return found


def _definitions(source: str) -> dict[str, list[tuple[str, bool]]]:
    """{name: [(argument, whether it has a default)]} of each ``m.def("name", ...)`` in C++
    ``source`` that names its arguments (pybind11::arg)."""
    found = {}
    for match in re.finditer(r'm\.def\(\s*"(\w+)"', source):
        depth, i, quoted = 1, match.end(), False
        while depth:  # to the call's closing parenthesis, past the parentheses inside its strings
            c = source[i]
            if quoted:
                i += c == "\\"
                quoted = c != '"'
            else:
                quoted = c == '"'
                depth += {"(": 1, ")": -1}.get(c, 0)
            i += 1
        arguments = re.findall(r'pybind11::arg\("(\w+)"\)(?:\.\w+\([^)]*\))*\s*(=)?', source[match.end() : i])
        if arguments:
            found[match.group(1)] = [(name, bool(default)) for name, default in arguments]
    return found


EXTENSION = {name: arguments for path in sorted((ROOT / "csrc").rglob("*.c*")) for name, arguments in _definitions(path.read_text()).items()}
# How graphquant's modules, tests and benchmarks name the extension module where they call it.
EXTENSION_RECEIVER = re.compile(r"(ext|extension|graphquant\._C|_C|_ext\(\)|(native\.)?extension_for\(.*\))")


def wrong_extension_arguments(call: ast.Call) -> list[str]:
    """What of ``call``'s arguments, a call of the extension's function, its definition refuses."""
    arguments = EXTENSION[call.func.attr]
    names = [name for name, _ in arguments]
    wrong = [f"no argument {k.arg}" for k in call.keywords if k.arg not in names]
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return wrong
    given = set(names[: len(call.args)]) | {k.arg for k in call.keywords}
    if len(call.args) > len(names):
        wrong.append(f"{len(call.args)} positional arguments, it takes {len(names)}")
    missing = [name for name, default in arguments if not default and name not in given]
    return wrong + [f"no {', '.join(missing)}"] * bool(missing)


def extension_call_problems(path: pathlib.Path) -> list[str]:
    """``path``'s calls of the extension's functions with arguments their definitions refuse."""
    return [f"{node.lineno}: {ast.unparse(node.func)}(...): {w}" for node in ast.walk(tree_of(path))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in EXTENSION
            and EXTENSION_RECEIVER.fullmatch(ast.unparse(node.func.value)) for w in wrong_extension_arguments(node)]


@pytest.mark.parametrize("path", CHECKED, ids=[str(p.relative_to(ROOT)) for p in CHECKED])
def test_names_taken_from_modules_exist(path):
    assert not stale_references(path)


def test_calls_of_the_extension_pass_the_arguments_it_takes():
    assert {"quantize", "fp8_gemm", "block_gemm", "mixed_gemm", "bf16_gemm", "grouped_fp8_tokens_by_tokens"} <= EXTENSION.keys()
    problems = {str(path.relative_to(ROOT)): found for path in LIBRARY if (found := extension_call_problems(path))}
    assert not problems


def test_the_check_finds_a_call_the_extension_refuses(tmp_path):
    """block_gemm (a, b, a_scale, b_scale, out_dtype, bias): one argument short, one too many, a
    keyword it does not name."""
    caller = tmp_path / "caller.py"
    caller.write_text(
        "def gemm(ext, a, b, s, t, dtype, bias):\n"
        "    ext.block_gemm(a, b, s, t, dtype, bias)\n"
        "    ext.block_gemm(a, b, s, t, dtype)\n"
        "    ext.block_gemm(a, b, s, t, dtype, bias, 0, 1, 2)\n"
        "    ext.block_gemm(a, b, s, t, dtype, bias=bias, split=2)\n"
    )
    found = extension_call_problems(caller)
    assert [line.split(":")[0] for line in found] == ["3", "4", "5"], found
    assert "no bias" in found[0] and "positional arguments" in found[1] and "no argument split" in found[2], found


def test_the_check_finds_a_removed_name(tmp_path):
    """A stand-in of a GPU test that still calls a helper its kernel module no longer has."""
    test = tmp_path / "test_stand_in.py"
    test.write_text(
        "from graphquant.kernels import triton_scales\n"
        "import graphquant.formats.fp8 as fp8\n"
        "from graphquant.formats.fp8 import tensor_amax, no_such_name\n"
        "CODES = triton_scales\n"
        "def test(x):\n"
        "    triton_scales.fp8_codes, fp8.tensor_amax, CODES.fp8_codes, fp8.tensor_amax(x=x), fp8.tensor_amax(x)\n"
        "    triton_scales._cast, fp8.no_such_amax, CODES._cast\n"
        "    fp8.tensor_amax(x, 1), fp8.tensor_amax(x, dim=1)\n"
    )
    found = stale_references(test)
    assert [line.split(":")[0] for line in found] == ["3", "7", "7", "7", "8", "8"], found
    assert "no_such_name" in found[0] and all("binds no" in f for f in found[1:4]), found
    assert "2 positional arguments, it takes 1" in found[4] and "no parameter dim" in found[5], found
