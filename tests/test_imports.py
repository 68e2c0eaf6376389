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
