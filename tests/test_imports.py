"""Static dependency-direction checks over `pagedlm/**/*.py` (ast only, nothing imported).

Layers, from the bottom:
  * `pagedlm/core/`, `pagedlm/config.py`, `pagedlm/sampling_params.py`: pure Python policy
    and validation; never torch; `core` never reaches up into engine / worker / entrypoints
    / models (or the other tensor packages).
  * `models`, `layers`, `attention`: tensor code; they never import the engine, the
    entrypoints or the scheduler.
  * Only `pagedlm/entrypoints` talks HTTP (fastapi, uvicorn, ...).

Imports under `if TYPE_CHECKING:` are ignored: they never run.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG_DIR = ROOT / "pagedlm"

HTTP_LIBS = {
    "fastapi",
    "uvicorn",
    "starlette",
    "sse_starlette",
    "aiohttp",
    "httpx",
    "requests",
    "http",
    "urllib3",
    "websockets",
    "flask",
    "werkzeug",
    "grpc",
}

TORCH_FREE = ("pagedlm.core", "pagedlm.config", "pagedlm.sampling_params")
TENSOR_PACKAGES = ("pagedlm.models", "pagedlm.layers", "pagedlm.attention")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. "pagedlm.core.scheduler"
    path: str  # relative file path, for messages
    line: int
    target: str  # absolute dotted name of what is imported
    module_level: bool  # runs when the importing module is imported

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    if node.module:
        base = base + node.module.split(".")
    return ".".join(base)


def imports_in_source(
    source: str, module: str, path: str, is_package: bool, known_modules: set[str]
) -> list[Import]:
    tree = ast.parse(source, filename=path)
    found: list[Import] = []

    def visit(node: ast.AST, module_level: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, module_level)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(module, path, node.lineno, alias.name, module_level))
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, is_package, node)
            for alias in node.names:
                # `from pkg import sub` imports the submodule `pkg.sub` when there is one.
                sub = f"{base}.{alias.name}"
                target = sub if sub in known_modules else base
                found.append(Import(module, path, node.lineno, target, module_level))
        inner = module_level and not isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
        )
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, True)
    return found


def _scan() -> tuple[list[Import], set[str]]:
    files = sorted(PKG_DIR.rglob("*.py"))
    known = {module_name(f, ROOT) for f in files}
    result: list[Import] = []
    for f in files:
        mod = module_name(f, ROOT)
        result += imports_in_source(
            f.read_text(encoding="utf-8"),
            mod,
            str(f.relative_to(ROOT)),
            f.name == "__init__.py",
            known,
        )
    return result, known


IMPORTS, MODULES = _scan()


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def within_any(name: str, prefixes) -> bool:
    return any(within(name, p) for p in prefixes)


def report(violations: list[Import], what: str) -> str:
    lines = [f"{i.where()}: {i.module} imports {i.target}" for i in violations]
    return f"{what}:\n  " + "\n  ".join(lines)


# ----- the scanner itself ---------------------------------------------------------------


def test_scanner_sees_the_package() -> None:
    assert {"pagedlm", "pagedlm.core.scheduler", "pagedlm.sampling_params"} <= MODULES
    assert any(i.module == "pagedlm.core.scheduler" for i in IMPORTS)


def test_scanner_resolves_relative_and_skips_type_checking() -> None:
    src = """
from typing import TYPE_CHECKING
import torch.nn as nn
from . import block_pool
from .request import Request
from .. import config
from ..engine import llm_engine
if TYPE_CHECKING:
    import fastapi
else:
    import json
def f():
    import uvicorn
class C:
    import numpy
"""
    known = {"pagedlm.core.block_pool", "pagedlm.config", "pagedlm.engine.llm_engine"}
    got = imports_in_source(src, "pagedlm.core.x", "x.py", False, known)
    targets = [(i.target, i.module_level) for i in got]
    assert targets == [
        ("typing", True),
        ("torch.nn", True),
        ("pagedlm.core.block_pool", True),
        ("pagedlm.core.request", True),
        ("pagedlm.config", True),
        ("pagedlm.engine.llm_engine", True),
        ("json", True),
        ("uvicorn", False),
        ("numpy", True),
    ]
    # In a package's __init__, `.` is the package itself.
    got = imports_in_source("from .a import b", "pagedlm.pkg", "i.py", True, set())
    assert [i.target for i in got] == ["pagedlm.pkg.a"]


# ----- the rules ------------------------------------------------------------------------


def test_torch_free_modules_never_import_torch() -> None:
    bad = [i for i in IMPORTS if within_any(i.module, TORCH_FREE) and within(i.target, "torch")]
    assert not bad, report(bad, "torch imported by a torch-free module")


def test_core_does_not_reach_up() -> None:
    forbidden = tuple(
        f"pagedlm.{p}"
        for p in (
            "engine",
            "worker",
            "entrypoints",
            "models",
            "layers",
            "attention",
            "sample",
            "loader",
            "benchmarks",
        )
    )
    bad = [
        i
        for i in IMPORTS
        if within(i.module, "pagedlm.core")
        # The bare root package re-exports LLM, i.e. imports the entrypoints.
        and (within_any(i.target, forbidden) or i.target == "pagedlm")
    ]
    assert not bad, report(bad, "pagedlm.core imports a higher layer")


def test_tensor_packages_do_not_import_engine_or_scheduler() -> None:
    forbidden = ("pagedlm.engine", "pagedlm.entrypoints", "pagedlm.core.scheduler")
    bad = [
        i
        for i in IMPORTS
        if within_any(i.module, TENSOR_PACKAGES)
        and (within_any(i.target, forbidden) or i.target == "pagedlm")
    ]
    assert not bad, report(bad, "models/layers/attention import engine/entrypoints/scheduler")


def test_only_entrypoints_speak_http() -> None:
    bad = [
        i
        for i in IMPORTS
        if not within(i.module, "pagedlm.entrypoints") and i.target.split(".")[0] in HTTP_LIBS
    ]
    assert not bad, report(bad, "HTTP library imported outside pagedlm/entrypoints")


def _import_closure(start: str) -> dict[str, Import | None]:
    """Modules loaded by `import start`, following module-level imports and parent
    packages' __init__ files. Maps each to the import that first pulled it in."""
    by_module: dict[str, list[Import]] = {}
    for i in IMPORTS:
        if i.module_level:
            by_module.setdefault(i.module, []).append(i)
    seen: dict[str, Import | None] = {}
    todo: list[tuple[str, Import | None]] = [(start, None)]
    while todo:
        name, via = todo.pop()
        parts = name.split(".")
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            if prefix in seen:
                continue
            seen[prefix] = via
            for i in by_module.get(prefix, ()):
                todo.append((i.target, i))
    return seen


def _chain(closure: dict[str, Import | None], name: str) -> str:
    steps = []
    while (via := closure.get(name)) is not None and len(steps) < 20:
        steps.append(f"{via.where()} ({via.module} -> {via.target})")
        name = via.module
    return "\n    ".join(reversed(steps))


@pytest.mark.parametrize(
    "start", ["pagedlm.sampling_params", "pagedlm.config", "pagedlm.core.scheduler"]
)
def test_torch_free_modules_do_not_load_torch_transitively(start: str) -> None:
    closure = _import_closure(start)
    torch_mods = [m for m in closure if within(m, "torch")]
    assert not torch_mods, f"`import {start}` loads torch via:\n    " + _chain(
        closure, torch_mods[0]
    )


# ----- the whole graph: one direction, no cycles ---------------------------------------
#
# Every import between pagedlm modules counts here, function-local ones included: an import
# deferred into a function still ties the two modules together, and deferring it to dodge
# a cycle only hides the cycle.

# The layers of the package, from the bottom (STYLE.md's picture): a module imports only
# from its own layer or those below.
LAYERS: tuple[tuple[str, ...], ...] = (
    # pure Python policy, data and validation (torch-free where TORCH_FREE says so)
    ("pagedlm.core", "pagedlm.config", "pagedlm.sampling_params", "pagedlm.structured",
     "pagedlm.outputs"),
    ("pagedlm.csrc",),  # the C++ kernels and their build
    ("pagedlm.attention",),
    ("pagedlm.layers",),
    ("pagedlm.models",),
    ("pagedlm.loader", "pagedlm.lora", "pagedlm.sample"),
    ("pagedlm.worker",),
    ("pagedlm.executor",),
    ("pagedlm.engine",),
    # what users run: the offline LLM, the server, the CLI and its benchmarks, and the root
    # package that re-exports the public API
    ("pagedlm.entrypoints", "pagedlm.benchmarks", "pagedlm"),
)

# Function-local imports of pagedlm modules are for optional dependencies only: the
# imported module needs a package the base install may lack. Two other kinds: the two
# command-line dispatchers load a subcommand's implementation when it runs, so that
# building the parser (`pagedlm --help`) stays light; and a spawned process's entry point
# imports what only the child needs, so that the parent can start it before its own
# heavy imports (`pagedlm serve` starts the engine core first).
OPTIONAL_LIBS = {"triton", "ray", "llama_cpp", "matplotlib", "peft", "llguidance"}
LAZY_IMPORTERS = {"pagedlm.entrypoints.cli", "pagedlm.benchmarks.cli",
                  "pagedlm.engine.core_launch"}


def _known(target: str) -> str:
    """The module a dotted import target lands in (`pagedlm.x.name` -> `pagedlm.x`)."""
    while target not in MODULES and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def _layer(module: str) -> int:
    best, rank = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            # The longest matching prefix decides (the root "pagedlm" matches everything).
            if within(module, p) and len(p) > best:
                best, rank = len(p), i
    return rank


def _internal_edges() -> list[Import]:
    return [i for i in IMPORTS
            if within(i.target, "pagedlm") and _known(i.target) != i.module]


def test_every_module_has_a_layer() -> None:
    unplaced = sorted({m for m in MODULES if m != "pagedlm" and _layer(m) == len(LAYERS) - 1
                       and not within_any(m, LAYERS[-1][:2])})
    assert not unplaced, f"modules outside every layer of LAYERS: {unplaced}"


def test_imports_point_down() -> None:
    bad = [i for i in _internal_edges() if _layer(_known(i.target)) > _layer(i.module)]
    assert not bad, report(bad, "a module imports from a higher layer")


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    edges: dict[str, set[str]] = {}
    for i in _internal_edges():
        edges.setdefault(i.module, set()).add(_known(i.target))
    cycles = _cycles(edges)
    lines = []
    for component in cycles:
        members = set(component)
        lines += [f"{i.where()}: {i.module} -> {_known(i.target)}" for i in _internal_edges()
                  if i.module in members and _known(i.target) in members]
    assert not cycles, "import cycles:\n  " + "\n  ".join(lines)


def _imports_optional_lib(module: str) -> bool:
    """Whether importing `module` imports an optional dependency, directly or through the
    modules it imports at the top."""
    return any(m.split(".")[0] in OPTIONAL_LIBS for m in _import_closure(module))


def test_function_local_imports_keep_optional_dependencies_optional() -> None:
    bad = [i for i in _internal_edges()
           if not i.module_level and i.module not in LAZY_IMPORTERS
           and not _imports_optional_lib(_known(i.target))]
    assert not bad, report(bad, "function-local imports of pagedlm modules that need no optional "
                                "dependency (import them at the top of the module)")

