"""The C++ CPU kernels in this directory, each compiled on first use and cached.

Every ``<stem>.cpp`` here is its own extension module, except the kernels the C++ decoder
compiles with its own (``BUNDLED``): their functions are in the decoder's module, so their
code compiles once. The sources include no torch or pybind11 header (lite_tensor.h and
lite_bind.h stand in for the little they need): parsing those took more of a first
start's build than the kernels themselves. The build uses torch's extension builder (a
C++ compiler and ninja), once per source version and CPU; later processes load the cached
library in well under a second. Where no compiler is available
:func:`load_extension` returns None and the caller falls back to its pure-torch path,
with a warning that says why. ``PAGEDLM_DISABLE_CPU_KERNELS=1`` turns every kernel off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).resolve().parent
DISABLE_ENV = "PAGEDLM_DISABLE_CPU_KERNELS"
# Compiler and linker flags of every kernel in this directory.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fvisibility=hidden"]
LDFLAGS = ["-fopenmp"]


@functools.cache
def _build_tag() -> str:
    """A short hash of the CPU's feature flags and of this directory's path. The libraries
    are built with -march=native, so a cache shared between machines must not mix their
    builds; and torch's builder keys a build by its name alone, so sources in another
    directory (a second checkout) under the same name would rebuild it on every switch,
    silently, where a name of their own is built once, announced."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256(f"{flags}\0{CSRC_DIR}".encode()).hexdigest()[:8]


# Kernel files llama_decode_cpu.cpp #includes: no module of their own, the decoder's
# exports their functions (each file's bind_<stem>).
BUNDLED = {stem: "llama_decode_cpu" for stem in (
    "block_gemv_cpu", "layer_ops_cpu", "lora_cpu", "paged_attention_cpu", "panel_gemm_cpu",
    "q8_gemm_cpu", "shm_allreduce_cpu")}


# Libraries built from more than their own source: translation units the compiler runs in
# parallel (paged attention takes as long to compile as every other decoder kernel together).
LIBRARY_SOURCES = {"llama_decode_cpu": ["llama_decode_cpu", "paged_attention_cpu"]}


def library_sources(stem: str) -> list[Path]:
    """The .cpp files the library `stem` compiles, each a translation unit."""
    return [CSRC_DIR / f"{name}.cpp" for name in LIBRARY_SOURCES.get(stem, [stem])]


def kernel_stems() -> list[str]:
    """The kernels built as libraries of their own (every source but the bundled ones)."""
    return [s.stem for s in sorted(CSRC_DIR.glob("*.cpp")) if s.stem not in BUNDLED]


# JSON {stem: library file} of kernels a parent process has already built and loaded (see
# load_all_extensions): imported straight from the file, never through torch's builder,
# whose lock file a process killed while holding it leaves behind for every later load.
PREBUILT_ENV = "PAGEDLM_PREBUILT_KERNELS"


def _import_library(name: str, path: str) -> ModuleType:
    import torch  # noqa: F401 - loads libc10 and libtorch, which the library links against

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
        return _import_library(extension_name(stem), prebuilt)
    try:
        from torch.utils.cpp_extension import load

        with _build_lock(stem):
            return load(
                name=extension_name(stem),
                sources=[str(path) for path in library_sources(stem)],
                # Copies: torch appends its own flags to the lists it is given, and the
                # grown lists would change the next kernel's build file, relinking it for
                # nothing.
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                verbose=False,
            )
    except Exception as e:  # no compiler, no ninja, a read-only cache, ...
        logger.warning("CPU kernels %s unavailable (%s: %s); using the torch path", stem,
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


@contextlib.contextmanager
def _build_lock(stem: str):
    """Hold this kernel's build lock (an flock on a file beside its build): one process
    builds it at a time, and the kernel releases the lock of a process that dies, however
    it dies. torch's builder has a lock of its own, a file it creates and deletes, that a
    builder killed mid-build leaves behind for every later build to wait on, silently and
    forever; under this lock no other build can be running, so such a file is stale and
    is removed (and said)."""
    import fcntl

    folder = _built_library(stem).parent
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "pagedlm.flock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for another process building the %s kernel", stem)
            fcntl.flock(f, fcntl.LOCK_EX)
        torch_lock = folder / "lock"
        if torch_lock.exists():
            logger.warning("removing the build lock %s that a killed build left", torch_lock)
            torch_lock.unlink(missing_ok=True)
        yield


def extension_name(stem: str) -> str:
    return f"pagedlm_{stem}_{_build_tag()}"


def _built_library(stem: str) -> Path:
    """Where torch's builder keeps the library of `stem` (the path it would create; this
    does not create it): in TORCH_EXTENSIONS_DIR itself when that is set, else in a
    folder per Python and accelerator under torch's default root."""
    import sys

    import torch
    from torch.utils.cpp_extension import get_default_build_root

    name = extension_name(stem)
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        if torch.version.hip is not None:
            flavour = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            flavour = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            flavour = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{python}_{flavour}")
    return Path(root) / name / f"{name}.so"


def unbuilt_kernels() -> list[str]:
    """The kernels with no library built yet, or one older than a file it compiles (an
    upgrade): they compile on their first load, which prepare_cpu_kernels announces."""
    stale = []
    for stem in kernel_stems():
        library = _built_library(stem)
        newest = max(path.stat().st_mtime for path in _sources_of(stem))
        if not library.exists() or library.stat().st_mtime < newest:
            stale.append(stem)
    return stale


def _sources_of(stem: str) -> list[Path]:
    """The files a kernel's build reads from this directory: its sources and what they
    #include from here (kernel files, headers), recursively."""
    seen: dict[str, Path] = {}
    todo = [path.name for path in library_sources(stem)]
    while todo:
        name = todo.pop()
        path = CSRC_DIR / name
        if name in seen or not path.is_file():
            continue
        seen[name] = path
        todo += re.findall(r'^#include "([\w.]+)"', path.read_text(encoding="utf-8"),
                           flags=re.MULTILINE)
    return list(seen.values())


def prepare_cpu_kernels() -> None:
    """Build every kernel now, together, and say so: at engine start-up rather than
    silently inside the first request. A no-op when they are built (or disabled)."""
    if os.environ.get(DISABLE_ENV) or os.environ.get(PREBUILT_ENV):
        return
    missing = unbuilt_kernels()
    if missing:
        import time
        from concurrent.futures import ThreadPoolExecutor

        logger.warning("building %d CPU kernels, one time (about 15-20 s on two cores; "
                       "cached for later starts): %s", len(missing), ", ".join(missing))
        start = time.perf_counter()
        # The longest build first, so that no core is left with it at the end: the
        # decoder compiles six other kernel files with its own (about as long as the
        # other libraries together).
        missing.sort(key=_build_cost, reverse=True)
        # Each build is a compiler subprocess: threads run them side by side.
        with ThreadPoolExecutor(max(1, min(len(missing), os.cpu_count() or 1))) as pool:
            list(pool.map(load_extension, missing))
        logger.warning("CPU kernels built in %.0f s", time.perf_counter() - start)
    load_all_extensions()


def _build_cost(stem: str) -> int:
    """Bytes of C++ a kernel compiles from this directory."""
    return sum(path.stat().st_size for path in _sources_of(stem))


def load_all_extensions() -> dict[str, str]:
    """Build (or load) every kernel here now; returns {stem: library file} of those that
    loaded, for PREBUILT_ENV. Tensor-parallel ranks start several processes at once: with
    the libraries built beforehand and named to them, they only import the files, and a
    rank killed at start-up can never leave torch's build lock behind for the others."""
    files = {}
    for stem in kernel_stems():
        module = load_extension(stem)
        if module is not None and getattr(module, "__file__", None):
            files[stem] = module.__file__
    return files
