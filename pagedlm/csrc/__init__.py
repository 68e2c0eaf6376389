"""The C++ CPU kernels in this directory, built once per source version and CPU and cached.

Every ``<stem>.cpp`` here is its own extension module, except the kernels the C++ decoder
compiles with its own (``BUNDLED``): their functions are in the decoder's module, so their
code compiles once. The sources include no torch or pybind11 header (lite_tensor.h and
lite_bind.h stand in for the little they need): parsing those took more of a first
start's build than the kernels themselves. build.py compiles them with the C++ compiler
alone, no torch, so pip's install starts the build in the background (build_backend/);
later processes load the cached library in well under a second. Where no compiler is
available :func:`load_extension` returns None and the caller falls back to its pure-torch
path, with a warning that says why. ``PAGEDLM_DISABLE_CPU_KERNELS=1`` turns every kernel off.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

from pagedlm.csrc.build import (  # noqa: F401 - the kernels' build, re-exported
    BUNDLED,
    CFLAGS,
    CSRC_DIR,
    LDFLAGS,
    LIBRARY_SOURCES,
    NO_COMPILER_FIX,
    BuildError,
    build_library,
    compiler,
    ensure_built,
    extension_name,
    kernel_dir,
    kernel_stems,
    library_key,
    library_path,
    library_sources,
    sources_of,
)

logger = logging.getLogger(__name__)

DISABLE_ENV = "PAGEDLM_DISABLE_CPU_KERNELS"

# JSON {stem: library file} of kernels a parent process has already built and loaded (see
# load_all_extensions): tensor-parallel ranks import them straight from the file.
PREBUILT_ENV = "PAGEDLM_PREBUILT_KERNELS"


def _import_library(name: str, path: str) -> ModuleType:
    # torch first: the libraries link OpenMP by its soname, which then resolves to the
    # runtime torch loaded, so kernels and torch share one thread pool.
    import torch  # noqa: F401

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_variant(prefix: str, sources: list[Path], cflags: list[str]) -> ModuleType:
    """`sources` built with `cflags` instead of the kernels' own (another -march: the ISA
    builds of tests/isa_builds.py and test_lite_tensor), named `prefix`_<key>, built once
    into the kernel folder and imported. Raises BuildError when it does not build."""
    name = f"{prefix}_{library_key(sources, cflags, LDFLAGS)}"
    out = kernel_dir() / f"{name}.so"
    if not out.exists():
        build_library(name, sources, out, cflags=cflags)
    return _import_library(name, str(out))


# Kernels whose build failed in this process (prepare_cpu_kernels): not tried again.
_failed: dict[str, BuildError] = {}


def _waiting(stems: list[str], holder: str) -> None:
    logger.warning("waiting for another process building the CPU kernels %s (%s)",
                   ", ".join(stems), holder or "no details")


@functools.cache
def load_extension(stem: str) -> ModuleType | None:
    """The compiled module of ``csrc/<stem>.cpp``, or None if disabled or unbuildable (for
    a bundled kernel: the decoder's module, which holds its functions)."""
    if os.environ.get(DISABLE_ENV):
        return None
    if stem in BUNDLED:
        return load_extension(BUNDLED[stem])
    prebuilt = json.loads(os.environ.get(PREBUILT_ENV, "{}")).get(stem)
    if prebuilt is not None:
        return _import_library(Path(prebuilt).stem, prebuilt)  # the file's name is the module's
    if stem in _failed:
        return None  # prepare_cpu_kernels has said why
    try:
        built = ensure_built([stem], on_wait=_waiting)[stem]
        if isinstance(built, BuildError):
            raise built
        return _import_library(extension_name(stem), str(built))
    except Exception as e:  # no compiler, a read-only cache, a compile error, ...
        logger.warning("CPU kernels %s unavailable (%s: %s); using the torch path", stem,
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        logger.debug("%s", e)
        return None


def unbuilt_kernels() -> list[str]:
    """The kernels whose library for these sources is not built yet: they compile on
    their first load, which prepare_cpu_kernels announces."""
    return [stem for stem in kernel_stems() if not library_path(stem).exists()]


def prepare_cpu_kernels() -> None:
    """Build every kernel now, together, and say so: at engine start-up rather than
    silently inside the first request (or wait for the build pip's install started). A
    no-op when they are built (or disabled)."""
    if os.environ.get(DISABLE_ENV) or os.environ.get(PREBUILT_ENV):
        return
    missing = unbuilt_kernels()
    if missing and shutil.which(compiler()) is None:
        _failed.update(dict.fromkeys(missing, BuildError("no C++ compiler")))
        logger.warning("CPU kernels %s unavailable: no C++ compiler (%r is not on the PATH: "
                       "%s); using the slower torch path", ", ".join(missing), compiler(),
                       NO_COMPILER_FIX)
    elif missing:
        import time

        start = time.perf_counter()
        built: list[str] = []

        def building(stems: list[str]) -> None:
            built.extend(stems)
            logger.warning("building %d CPU kernels, one time (about 15-20 s on two cores; "
                           "cached for later starts): %s", len(stems), ", ".join(stems))

        try:
            result = ensure_built(kernel_stems(), on_build=building, on_wait=_waiting)
        except Exception as e:  # a read-only kernel folder, ...: each load says it again
            result = dict.fromkeys(kernel_stems(), BuildError(f"{type(e).__name__}: {e}"))
        for stem, error in result.items():
            if isinstance(error, BuildError):
                _failed[stem] = error
                logger.warning("CPU kernels %s unavailable (%s); using the torch path", stem,
                               error)
        if len(_failed) < len(result):
            logger.warning("CPU kernels %s in %.0f s", "built" if built else "ready",
                           time.perf_counter() - start)
    load_all_extensions()


def load_all_extensions() -> dict[str, str]:
    """Build (or load) every kernel here now; returns {stem: library file} of those that
    loaded, for PREBUILT_ENV. Tensor-parallel ranks start several processes at once: with
    the libraries built beforehand and named to them, they only import the files."""
    files = {}
    for stem in kernel_stems():
        module = load_extension(stem)
        if module is not None and getattr(module, "__file__", None):
            files[stem] = module.__file__
    return files
