"""The builder of the C++ CPU kernels: the standard library only, no torch.

Each library is named by a hash of what makes it (its sources and every file of this
directory they include, the flags, the compiler, the Python and the CPU's features), so a
changed source or an upgrade builds a new one and nothing is ever stale; it is written
under a temporary name and renamed, so a library that exists is complete. One process
builds a library at a time: an flock beside it, which the kernel releases when its holder
dies, however it dies; a process that finds it held waits and is told who holds it.

Run as a script (``python pagedlm/csrc/build.py --install``) it builds every kernel that
is missing and exits at once if another process is building them: the package's build
backend starts it in the background when pip installs pagedlm (build_backend/), so that
the kernels compile while pip is still fetching and unpacking torch, and ``pagedlm
serve``'s first start only loads them.

Libraries live in $PAGEDLM_KERNEL_DIR, else $PAGEDLM_CACHE_DIR/kernels, else
$XDG_CACHE_HOME/pagedlm/kernels (~/.cache/pagedlm/kernels).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CSRC_DIR = Path(__file__).resolve().parent
# Compiler and linker flags of every kernel in this directory.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fvisibility=hidden"]
LDFLAGS = ["-fopenmp"]
# Flags every library needs whatever the caller's: a Python extension module in C++20.
BASE_CFLAGS = ["-fPIC", "-std=c++20"]
# Hex digits of a library's key in its name.
KEY_LENGTH = 12
# What to do without a compiler (both the build's error and the engine's warning say it).
NO_COMPILER_FIX = "install one, e.g. `apt install g++`, or name it in CXX"

# Kernel files with no library of their own: the decoder's exports their functions (each
# file's bind_<stem>), #included by llama_decode_cpu.cpp or compiled beside it
# (LIBRARY_SOURCES).
BUNDLED = {stem: "llama_decode_cpu" for stem in (
    "block_gemv_cpu", "layer_ops_cpu", "lora_cpu", "paged_attention_cpu", "panel_gemm_cpu",
    "prefill_attention_cpu", "q8_gemm_cpu", "shm_allreduce_cpu", "step_inputs_cpu")}

# Libraries built from more than their own source: translation units the compiler runs in
# parallel (each attention kernel takes about as long to compile as every other decoder
# kernel together).
LIBRARY_SOURCES = {"llama_decode_cpu": ["llama_decode_cpu", "paged_attention_cpu",
                                        "prefill_attention_cpu"]}


class BuildError(RuntimeError):
    """A kernel library failed to compile or link; the message ends with the compiler's
    last lines."""


def library_sources(stem: str) -> list[Path]:
    """The .cpp files the library `stem` compiles, each a translation unit."""
    return [CSRC_DIR / f"{name}.cpp" for name in LIBRARY_SOURCES.get(stem, [stem])]


def kernel_stems() -> list[str]:
    """The kernels built as libraries of their own (every source but the bundled ones)."""
    return [s.stem for s in sorted(CSRC_DIR.glob("*.cpp")) if s.stem not in BUNDLED]


def sources_of(sources: list[Path]) -> list[Path]:
    """The files a build reads: `sources` and what they #include "..." from their own
    folder or this one, recursively."""
    seen: dict[Path, None] = {}
    todo = list(sources)
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen[path] = None
        for name in re.findall(r'^#include "([\w.]+)"', path.read_text(encoding="utf-8"),
                               flags=re.MULTILINE):
            todo += [folder / name for folder in (path.parent, CSRC_DIR)
                     if (folder / name).is_file()][:1]
    return list(seen)


def kernel_dir() -> Path:
    if os.environ.get("PAGEDLM_KERNEL_DIR"):
        return Path(os.environ["PAGEDLM_KERNEL_DIR"])
    if os.environ.get("PAGEDLM_CACHE_DIR"):
        return Path(os.environ["PAGEDLM_CACHE_DIR"]) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "pagedlm" / "kernels"


def compiler() -> str:
    return os.environ.get("CXX") or "c++"


@functools.cache
def _toolchain() -> str:
    """What besides the sources makes a library: the CPU's features (-march=native), the
    compiler's version and the Python it is built for."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    try:
        version = subprocess.run([compiler(), "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.split("\n", 1)[0]
    except (OSError, subprocess.SubprocessError):
        version = "no compiler"
    return "\0".join([flags, version, sys.version, sysconfig.get_config_var("EXT_SUFFIX") or ""])


def library_key(sources: list[Path], cflags: list[str], ldflags: list[str]) -> str:
    digest = hashlib.sha256(_toolchain().encode())
    digest.update(json.dumps([BASE_CFLAGS, cflags, ldflags]).encode())
    for path in sorted(sources_of(sources)):
        digest.update(f"\0{path.name}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:KEY_LENGTH]


@functools.cache
def _kernel_key(stem: str) -> str:
    return library_key(library_sources(stem), CFLAGS, LDFLAGS)


def extension_name(stem: str) -> str:
    """The module name of kernel `stem`'s library (its PyInit_ function's)."""
    return f"pagedlm_{stem}_{_kernel_key(stem)}"


def library_path(stem: str) -> Path:
    return kernel_dir() / f"{extension_name(stem)}.so"


def build_library(name: str, sources: list[Path], out: Path, *, cflags: list[str] = CFLAGS,
                  ldflags: list[str] = LDFLAGS) -> Path:
    """Compile `sources` (in parallel) and link them into the extension module `name` at
    `out`, which appears only when complete."""
    built = _build_all({name: (sources, out)}, cflags, ldflags)
    if isinstance(built[name], BuildError):
        raise built[name]
    return out


def _build_all(libraries: dict[str, tuple[list[Path], Path]], cflags: list[str],
               ldflags: list[str]) -> dict[str, Path | BuildError]:
    """Every translation unit of every library in one pool, the longest first so that no
    core is left alone with it at the end; each library linked once its units are done."""
    cxx = compiler()
    if shutil.which(cxx) is None:
        error = BuildError(f"no C++ compiler: {cxx!r} is not on the PATH ({NO_COMPILER_FIX})")
        return dict.fromkeys(libraries, error)
    python_include = Path(sysconfig.get_paths()["include"])
    if not (python_include / "Python.h").is_file():
        error = BuildError(f"no Python headers: Python.h is not in {python_include} (install "
                           "them, e.g. `apt install python3-dev`)")
        return dict.fromkeys(libraries, error)
    includes = [f"-I{python_include}", f"-I{CSRC_DIR}"]
    work = []
    temp = {}
    for name, (sources, out) in libraries.items():
        out.parent.mkdir(parents=True, exist_ok=True)
        temp[name] = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
        for i, source in enumerate(sources):
            obj = temp[name] / f"{i}_{source.stem}.o"
            argv = [cxx, *BASE_CFLAGS, *cflags, *includes, f"-DTORCH_EXTENSION_NAME={name}",
                    "-c", str(source), "-o", str(obj)]
            work.append((sum(p.stat().st_size for p in sources_of([source])), name, argv, obj))
    work.sort(key=lambda w: -w[0])

    def compile_one(item) -> tuple[str, Path, str | None]:
        _, name, argv, obj = item
        try:
            run = subprocess.run(argv, capture_output=True, text=True)
        except OSError as e:
            return name, obj, f"{argv[0]}: {e}"
        return name, obj, None if run.returncode == 0 else _tail(argv, run)

    jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    results: dict[str, Path | BuildError] = {}
    try:
        with ThreadPoolExecutor(max(1, min(len(work), jobs or 1))) as pool:
            objects: dict[str, list[Path]] = {name: [] for name in libraries}
            for name, obj, error in pool.map(compile_one, work):
                if error is not None:
                    results.setdefault(name, BuildError(error))
                objects[name].append(obj)
        for name, (_, out) in libraries.items():
            if name in results:
                continue
            partial = temp[name] / out.name
            argv = [cxx, "-shared", *sorted(map(str, objects[name])), *ldflags, "-o", str(partial)]
            run = subprocess.run(argv, capture_output=True, text=True)
            if run.returncode != 0:
                results[name] = BuildError(_tail(argv, run))
                continue
            os.replace(partial, out)
            results[name] = out
    finally:
        for folder in temp.values():
            shutil.rmtree(folder, ignore_errors=True)
    return results


def _tail(argv: list[str], run: subprocess.CompletedProcess) -> str:
    lines = (run.stderr or run.stdout or "").strip().splitlines()
    return (f"{Path(argv[0]).name} exited with {run.returncode} building "
            f"{Path(argv[argv.index('-o') + 1]).name}: " + "\n".join(lines[-15:]))


@contextlib.contextmanager
def _locks(stems: list[str], wait: bool,
           on_wait: Callable[[list[str], str], None] | None) -> Iterator[list[str]]:
    """Hold the build locks of `stems`; yields the stems whose lock this process holds.
    Those another process holds are waited for, once every other is held (or, without
    `wait`, left out)."""
    files, held, busy = [], [], []
    try:
        for stem in sorted(stems):
            path = library_path(stem).with_suffix(".lock")
            path.parent.mkdir(parents=True, exist_ok=True)
            f = open(path, "a+")
            files.append(f)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append((stem, f))
            except BlockingIOError:
                busy.append((stem, f))
        if busy and wait:
            if on_wait is not None:
                busy[0][1].seek(0)
                on_wait([stem for stem, _ in busy], busy[0][1].read().strip())
            for stem, f in busy:
                fcntl.flock(f, fcntl.LOCK_EX)
                held.append((stem, f))
        for _, f in held:
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} ({_who()}) since {time.strftime('%H:%M:%S')}\n")
            f.flush()
        yield [stem for stem, _ in held]
    finally:
        for f in files:
            f.close()  # releases its flock


def _who() -> str:
    return os.environ.get("PAGEDLM_BUILD_BY") or " ".join(Path(a).name for a in sys.argv[:2])


def ensure_built(stems: list[str], *, wait: bool = True,
                 on_build: Callable[[list[str]], None] | None = None,
                 on_wait: Callable[[list[str], str], None] | None = None
                 ) -> dict[str, Path | BuildError]:
    """Build the kernel libraries of `stems` that do not exist yet, together; {stem: its
    library, or the BuildError that stopped it}. A library another process is building is
    waited for (on_wait is told which, and what the holder wrote in the lock) or, without
    `wait`, left out. on_build is told what this process builds, before it starts."""
    result: dict[str, Path | BuildError] = {}
    missing = []
    for stem in stems:
        if library_path(stem).exists():
            result[stem] = library_path(stem)
        else:
            missing.append(stem)
    if not missing:
        return result
    with _locks(missing, wait, on_wait) as held:
        todo = [stem for stem in held if not library_path(stem).exists()]
        for stem in todo:
            # Objects a builder killed mid-way left (SIGKILL, a container step's end): under
            # this library's lock no other process is building it.
            for folder in kernel_dir().glob(f".{extension_name(stem)}-*"):
                shutil.rmtree(folder, ignore_errors=True)
        if todo and on_build is not None:
            on_build(todo)
        built = _build_all({extension_name(s): (library_sources(s), library_path(s))
                            for s in todo}, CFLAGS, LDFLAGS) if todo else {}
        for stem in held:
            result[stem] = built.get(extension_name(stem), library_path(stem))
    for stem in todo:
        if isinstance(result[stem], Path):
            _prune(stem)
    return result


# Libraries kept per kernel: the newest, built from other sources (another checkout, the
# version before an upgrade); older ones are deleted when a new one is built.
KEEP_PER_KERNEL = 4


def _prune(stem: str) -> None:
    """Delete all but the KEEP_PER_KERNEL newest libraries of `stem` (a process that has
    one loaded keeps its mapping)."""
    libraries = sorted(kernel_dir().glob(f"pagedlm_{stem}_" + "?" * KEY_LENGTH + ".so"),
                       key=lambda path: path.stat().st_mtime, reverse=True)
    for old in libraries[KEEP_PER_KERNEL:]:
        with contextlib.suppress(OSError):
            old.unlink()
            old.with_suffix(".lock").unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    """``--install``: build every missing kernel unless another process is building it,
    saying what happened in kernel_dir()/install.log (what pip's install starts).
    ``--wait``: build every missing kernel, waiting for a build in progress, and print
    where they are (for a container image: `RUN pip install ... && python
    pagedlm/csrc/build.py --wait`, since a build in the background dies with the step)."""
    if argv == ["--wait"]:
        result = ensure_built(kernel_stems(), on_wait=lambda stems, holder: print(
            f"waiting for another process building {', '.join(stems)} ({holder})", flush=True))
        for stem, built in result.items():
            print(f"{stem}: {built}")
        return 0 if all(isinstance(v, Path) for v in result.values()) else 1
    if argv != ["--install"]:
        print(__doc__)
        return 2
    os.environ.setdefault("PAGEDLM_BUILD_BY", "started by pip install")
    # The lowest priority, for this process and its compilers: pip's own work (unpacking
    # torch) comes first, the build takes the CPU pip leaves (its waits on the network).
    with contextlib.suppress(OSError):
        os.nice(19)
    log = kernel_dir() / "install.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        if log.stat().st_size > 64 << 10:  # a log of every install: the last ones are kept
            log.write_text("".join(log.read_text().splitlines(keepends=True)[-100:]))
    start = time.monotonic()
    with open(log, "a") as f:
        def say(message: str) -> None:
            print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}", file=f, flush=True)

        stems = kernel_stems()
        built: list[str] = []

        def building(todo: list[str]) -> None:
            built.extend(todo)
            say(f"building {', '.join(todo)}")

        result = ensure_built(stems, wait=False, on_build=building)
        for stem in stems:
            if stem in built or stem not in result:
                say(f"{stem}: {result.get(stem, 'another process is building it')}")
        say(f"done in {time.monotonic() - start:.1f} s"
            + ("" if built or len(result) < len(stems) else ": every kernel was built already"))
    return 0 if all(isinstance(v, Path) for v in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
