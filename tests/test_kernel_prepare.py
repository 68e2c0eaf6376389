"""CPU kernels are built at engine start-up (or by pip's install), together and announced,
not silently inside the first request; nothing is said when they are already built. The
builder (pagedlm/csrc/build.py) names each library by a hash of what makes it, so a changed
source builds a new one; one process builds a library at a time, under an flock."""

from __future__ import annotations

import fcntl
import logging
import shutil
import threading
from pathlib import Path

import pytest

from pagedlm import csrc
from pagedlm.csrc import build


@pytest.fixture
def kernel_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLM_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.delenv(csrc.PREBUILT_ENV, raising=False)
    monkeypatch.delenv(csrc.DISABLE_ENV, raising=False)
    return tmp_path / "kernels"


@pytest.fixture
def fake_compiler(monkeypatch):
    """_build_all writing empty libraries, recording which it was asked for."""
    built: list[str] = []

    def build_all(libraries, cflags, ldflags):
        for name, (_, out) in libraries.items():
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(b"")
            built.append(name.split("_", 1)[1].rsplit("_", 1)[0])
        return {name: out for name, (_, out) in libraries.items()}

    monkeypatch.setattr(build, "_build_all", build_all)
    return built


@pytest.fixture
def csrc_copy(tmp_path, monkeypatch):
    """The kernel sources copied to a folder whose files a test may change."""
    copy = tmp_path / "csrc"
    shutil.copytree(build.CSRC_DIR, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(build, "CSRC_DIR", copy)
    build._kernel_key.cache_clear()
    yield copy
    build._kernel_key.cache_clear()


def test_unbuilt_kernels_are_found_and_built_together(kernel_dir, fake_compiler, csrc_copy,
                                                      monkeypatch, caplog):
    stems = csrc.kernel_stems()
    # Every source builds as a library, except the kernels the decoder compiles with its own.
    assert sorted(stems + list(csrc.BUNDLED)) == sorted(p.stem for p in csrc_copy.glob("*.cpp"))
    assert set(csrc.BUNDLED.values()) <= set(stems)
    assert csrc.unbuilt_kernels() == stems  # an empty kernel folder: nothing is built
    monkeypatch.setattr(csrc, "load_all_extensions", lambda: {})

    with caplog.at_level(logging.WARNING, logger="pagedlm.csrc"):
        csrc.prepare_cpu_kernels()
    assert sorted(fake_compiler) == stems
    assert f"building {len(stems)} CPU kernels, one time" in caplog.text
    assert "CPU kernels built in" in caplog.text
    assert csrc.unbuilt_kernels() == []

    caplog.clear()
    fake_compiler.clear()
    with caplog.at_level(logging.WARNING, logger="pagedlm.csrc"):
        csrc.prepare_cpu_kernels()
    assert fake_compiler == [] and "building" not in caplog.text

    # A changed file a library compiles (an upgrade; here a translation unit only the
    # decoder's library has) is a library of another name, built, announced.
    decoder = "llama_decode_cpu"
    assert {"lite_tensor.h", "lite_bind.h", "paged_attention_cpu.cpp", "cpu_vec.h"} <= {
        p.name for p in csrc.sources_of(csrc.library_sources(decoder))}
    old = csrc.library_path(decoder)
    with open(csrc_copy / "paged_attention_cpu.cpp", "a") as f:
        f.write("\n// changed\n")
    build._kernel_key.cache_clear()
    assert csrc.library_path(decoder) != old and csrc.unbuilt_kernels() == [decoder]
    with caplog.at_level(logging.WARNING, logger="pagedlm.csrc"):
        csrc.prepare_cpu_kernels()
    assert fake_compiler == [decoder] and "building 1 CPU kernels, one time" in caplog.text


def test_a_build_held_by_another_process_is_waited_for_and_said(kernel_dir, fake_compiler,
                                                                  caplog):
    """The flock is the kernel's: the holder's death releases it, however it dies. A held
    one means a build is running: the waiter says who holds it, waits, and builds nothing
    the holder built."""
    library = csrc.library_path("sampler_cpu")
    library.parent.mkdir(parents=True)
    holder = open(library.with_suffix(".lock"), "a+")
    fcntl.flock(holder, fcntl.LOCK_EX)
    holder.write("pid 1 (started by pip install) since 12:00:00\n")
    holder.flush()
    done = threading.Event()

    def start():
        csrc.ensure_built(["sampler_cpu"], on_wait=csrc._waiting)
        done.set()

    with caplog.at_level(logging.WARNING, logger="pagedlm.csrc"):
        thread = threading.Thread(target=start)
        thread.start()
        assert not done.wait(1.0)
        assert ("waiting for another process building the CPU kernels sampler_cpu "
                "(pid 1 (started by pip install) since 12:00:00)") in caplog.text
        library.write_bytes(b"")  # the holder's build, complete
        holder.close()
        thread.join(30)
    assert done.is_set() and fake_compiler == []


def test_the_install_build_leaves_a_held_build_to_its_holder(kernel_dir, fake_compiler):
    """`build.py --install` (pip's background build) never waits: what another process is
    building is left to it, the rest is built, and the log says what happened."""
    lock = csrc.library_path("sampler_cpu").with_suffix(".lock")
    lock.parent.mkdir(parents=True)
    with open(lock, "a+") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        assert build.main(["--install"]) == 0
    assert sorted(fake_compiler) == sorted(set(csrc.kernel_stems()) - {"sampler_cpu"})
    log = (kernel_dir / "install.log").read_text()
    assert "building llama_decode_cpu" in log and "done in" in log
    assert build.main(["--install"]) == 0  # a second run has nothing to do
    assert "sampler_cpu" in fake_compiler


def test_a_compile_error_is_said_and_leaves_nothing_behind(kernel_dir, csrc_copy, caplog):
    source = csrc_copy / "sampler_cpu.cpp"
    source.write_text('#error "a broken kernel"\n' + source.read_text())
    result = csrc.ensure_built(["sampler_cpu"])["sampler_cpu"]
    assert isinstance(result, csrc.BuildError)
    assert "exited with 1 building 0_sampler_cpu.o" in str(result) and "a broken kernel" in str(result)
    assert [p.suffix for p in kernel_dir.iterdir()] == [".lock"]  # no library, no objects

    csrc.load_extension.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="pagedlm.csrc"):
            assert csrc.load_extension("sampler_cpu") is None
    finally:
        csrc.load_extension.cache_clear()
    assert "CPU kernels sampler_cpu unavailable (BuildError" in caplog.text


def test_a_library_builds_and_loads_with_the_compiler_alone(kernel_dir, csrc_copy, monkeypatch):
    """A real build of the smallest kernel into an empty folder, with no torch in the
    builder's process (it is what pip's build backend runs), then loaded by this one."""
    import subprocess
    import sys

    script = Path(build.__file__)
    code = ("import sys; sys.modules['torch'] = None; "  # an import of torch would fail
            f"sys.path.insert(0, {str(script.parent)!r}); import build; "
            f"build.CSRC_DIR = build.Path({str(csrc_copy)!r}); "
            "r = build.ensure_built(['sampler_cpu']); print(r['sampler_cpu'])")
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                          timeout=300, env={"PAGEDLM_KERNEL_DIR": str(kernel_dir),
                                            "PATH": "/usr/bin:/bin:/usr/local/bin"})
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == csrc.library_path("sampler_cpu")
    assert sorted(p.suffix for p in kernel_dir.iterdir()) == [".lock", ".so"]
    csrc.load_extension.cache_clear()
    try:
        module = csrc.load_extension("sampler_cpu")
        assert module is not None and module.__file__ == str(csrc.library_path("sampler_cpu"))
    finally:
        csrc.load_extension.cache_clear()


def test_the_kernel_folder(monkeypatch, tmp_path):
    for name in ("PAGEDLM_KERNEL_DIR", "PAGEDLM_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert csrc.kernel_dir() == tmp_path / ".cache" / "pagedlm" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert csrc.kernel_dir() == tmp_path / "xdg" / "pagedlm" / "kernels"
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path / "c"))
    assert csrc.kernel_dir() == tmp_path / "c" / "kernels"
    monkeypatch.setenv("PAGEDLM_KERNEL_DIR", str(tmp_path / "k"))
    assert csrc.kernel_dir() == tmp_path / "k"


def test_the_engine_prepares_them_before_it_is_ready(tiny_llama_dir, monkeypatch):
    calls = []
    from pagedlm import LLM
    from pagedlm.worker import worker

    monkeypatch.setattr(worker, "prepare_cpu_kernels", lambda: calls.append("prepared"))

    LLM(tiny_llama_dir, skip_tokenizer_init=True, kv_cache_memory=8 << 20, max_model_len=128)
    assert calls == ["prepared"]


def test_no_compiler_is_one_clear_line_and_the_torch_path(kernel_dir, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "no-such-c++")
    csrc.load_extension.cache_clear()
    monkeypatch.setattr(csrc, "_failed", {})
    try:
        with caplog.at_level(logging.WARNING, logger="pagedlm.csrc"):
            csrc.prepare_cpu_kernels()
            assert csrc.load_extension("sampler_cpu") is None
    finally:
        csrc.load_extension.cache_clear()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["CPU kernels llama_decode_cpu, sampler_cpu "
                     "unavailable: no C++ compiler ('no-such-c++' is not on the PATH: install "
                     "one, e.g. `apt install g++`, or name it in CXX); using the slower torch "
                     "path"]

    # Loaded alone (no prepare first), a kernel says the same of itself.
    caplog.clear()
    monkeypatch.setattr(csrc, "_failed", {})
    try:
        with caplog.at_level(logging.WARNING, logger="pagedlm.csrc"):
            assert csrc.load_extension("sampler_cpu") is None
    finally:
        csrc.load_extension.cache_clear()
    assert [r.getMessage() for r in caplog.records] == [
        "CPU kernels sampler_cpu unavailable (BuildError: no C++ compiler: 'no-such-c++' is "
        "not on the PATH (install one, e.g. `apt install g++`, or name it in CXX)); using the "
        "torch path"]


def test_old_libraries_of_a_kernel_are_pruned(kernel_dir, fake_compiler, csrc_copy):
    """Every change of a kernel's sources is a library of its own: building one deletes
    all but the newest few of that kernel (other kernels' are kept)."""
    import os

    kernel_dir.mkdir()
    old = []
    for i in range(6):
        path = kernel_dir / f"pagedlm_sampler_cpu_{i:012d}.so"
        path.write_bytes(b"")
        path.with_suffix(".lock").write_text("")
        os.utime(path, (1000 + i, 1000 + i))
        old.append(path)
    other = kernel_dir / f"pagedlm_llama_decode_cpu_{0:012d}.so"
    other.write_bytes(b"")
    os.utime(other, (1, 1))
    csrc.ensure_built(["sampler_cpu"])
    kept = sorted(p.name for p in kernel_dir.glob("pagedlm_sampler_cpu_*.so"))
    assert kept == sorted([csrc.library_path("sampler_cpu").name] + [p.name for p in old[-3:]])
    assert not old[0].with_suffix(".lock").exists() and old[-1].with_suffix(".lock").exists()
    assert other.exists()


def test_no_python_headers_is_said(kernel_dir, csrc_copy, monkeypatch, tmp_path):
    import sysconfig

    paths = sysconfig.get_paths()
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {**paths, "include": str(tmp_path)})
    result = csrc.ensure_built(["sampler_cpu"])["sampler_cpu"]
    assert str(result) == (f"no Python headers: Python.h is not in {tmp_path} (install them, "
                           "e.g. `apt install python3-dev`)")


def test_a_killed_builders_objects_are_removed_and_wait_builds_in_the_foreground(
        kernel_dir, fake_compiler, capsys):
    """A builder killed mid-way (a container step's end kills pip's background build)
    leaves its object folder: the next build of that library removes it. `build.py
    --wait` builds what is missing in the foreground and says where each library is."""
    leftover = kernel_dir / f".{csrc.extension_name('sampler_cpu')}-abc123"
    leftover.mkdir(parents=True)
    (leftover / "0_sampler_cpu.o").write_bytes(b"")
    assert build.main(["--wait"]) == 0
    assert not leftover.exists()
    assert sorted(fake_compiler) == sorted(csrc.kernel_stems())
    out = capsys.readouterr().out
    assert f"sampler_cpu: {csrc.library_path('sampler_cpu')}" in out
