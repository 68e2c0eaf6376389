"""CPU kernels are built at engine start-up, together and announced, not silently inside
the first request; nothing is said when they are already built."""

from __future__ import annotations

import logging

from pagedlm import csrc


def test_unbuilt_kernels_are_found_and_built_together(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv(csrc.PREBUILT_ENV, raising=False)
    monkeypatch.delenv(csrc.DISABLE_ENV, raising=False)
    stems = csrc.kernel_stems()
    # Every source builds as a library, except the kernels the decoder compiles with its own.
    assert sorted(stems + list(csrc.BUNDLED)) == sorted(p.stem for p in csrc.CSRC_DIR.glob("*.cpp"))
    assert set(csrc.BUNDLED.values()) <= set(stems)
    assert csrc.unbuilt_kernels() == stems  # an empty build root: nothing is built

    built: list[str] = []

    def fake_build(stem: str):  # what torch's builder leaves behind
        library = csrc._built_library(stem)
        library.parent.mkdir(parents=True, exist_ok=True)
        library.write_bytes(b"")
        built.append(stem)

    monkeypatch.setattr(csrc, "load_extension", fake_build)
    monkeypatch.setattr(csrc, "load_all_extensions", lambda: {})
    with caplog.at_level(logging.WARNING, logger="pagedlm.csrc"):
        csrc.prepare_cpu_kernels()
    assert sorted(built) == stems
    assert f"building {len(stems)} CPU kernels, one time" in caplog.text
    assert "CPU kernels built in" in caplog.text
    assert csrc.unbuilt_kernels() == []

    caplog.clear()
    built.clear()
    with caplog.at_level(logging.WARNING, logger="pagedlm.csrc"):
        csrc.prepare_cpu_kernels()
    assert built == [] and "building" not in caplog.text

    # A library older than a file it compiles (an upgrade, here of a header the decoder
    # includes through another kernel file) is rebuilt, announced, not silently on load.
    decoder = "llama_decode_cpu"
    assert {"lite_tensor.h", "lite_bind.h", "paged_attention_cpu.cpp", "cpu_vec.h"} <= {
        p.name for p in csrc._sources_of(decoder)}
    import os

    os.utime(csrc._built_library(decoder), (0, 0))
    assert csrc.unbuilt_kernels() == [decoder]
    with caplog.at_level(logging.WARNING, logger="pagedlm.csrc"):
        csrc.prepare_cpu_kernels()
    assert built == [decoder] and "building 1 CPU kernels, one time" in caplog.text


def test_the_engine_prepares_them_before_it_is_ready(tiny_llama_dir, monkeypatch):
    calls = []
    from pagedlm import LLM
    from pagedlm.worker import worker

    monkeypatch.setattr(worker, "prepare_cpu_kernels", lambda: calls.append("prepared"))

    LLM(tiny_llama_dir, skip_tokenizer_init=True, kv_cache_memory=8 << 20, max_model_len=128)
    assert calls == ["prepared"]


def test_a_killed_build_leaves_no_lock_to_wait_on_forever(tmp_path, monkeypatch, caplog):
    """torch's builder waits, silently and forever, on the lock file a killed builder left.
    Builds take an flock of ours first, which the kernel releases when its holder dies:
    one held means a build is running (said, and waited for); none held means torch's file
    is stale (removed, and said)."""
    import fcntl
    import threading

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = csrc._built_library("sampler_cpu").parent
    folder.mkdir(parents=True)
    (folder / "lock").touch()  # what a builder killed inside torch's load() leaves
    with caplog.at_level(logging.WARNING, logger="pagedlm.csrc"):
        with csrc._build_lock("sampler_cpu"):
            assert not (folder / "lock").exists()
    assert "removing the build lock" in caplog.text

    # Another builder holds the flock: this one says so and waits until it lets go.
    caplog.clear()
    holder = open(folder / "pagedlm.flock", "a")
    fcntl.flock(holder, fcntl.LOCK_EX)
    entered = threading.Event()

    def build():
        with csrc._build_lock("sampler_cpu"):
            entered.set()

    with caplog.at_level(logging.WARNING, logger="pagedlm.csrc"):
        thread = threading.Thread(target=build)
        thread.start()
        assert not entered.wait(1.0)
        assert "waiting for another process building the sampler_cpu" in caplog.text
        holder.close()  # as the holder's death would: the kernel drops its flock
        thread.join(30)
    assert entered.is_set()


def test_a_second_checkout_gets_kernel_names_of_its_own(tmp_path, monkeypatch):
    """torch's builder keys a build by its name alone: sources in another directory under
    the same name would rebuild it silently on every switch, so the name carries the
    directory (and the CPU's flags)."""
    here = csrc.extension_name("sampler_cpu")
    assert here == csrc.extension_name("sampler_cpu")  # stable within a checkout
    monkeypatch.setattr(csrc, "CSRC_DIR", tmp_path)
    csrc._build_tag.cache_clear()
    try:
        elsewhere = csrc.extension_name("sampler_cpu")
    finally:
        monkeypatch.undo()
        csrc._build_tag.cache_clear()
    assert elsewhere != here and elsewhere.startswith("pagedlm_sampler_cpu_")
    assert csrc.extension_name("sampler_cpu") == here


def test_the_library_path_is_where_torchs_builder_puts_it(tmp_path, monkeypatch):
    """With TORCH_EXTENSIONS_DIR set torch builds in it directly, without the per-Python
    folder it adds under its default root: a path of our own that differed made every
    start announce (and lock) a build of kernels that were already built."""
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = csrc.extension_name("sampler_cpu")
    assert csrc._built_library("sampler_cpu").parent == tmp_path / name
    assert str(csrc._built_library("sampler_cpu").parent) == _get_build_directory(name, False)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert str(csrc._built_library("sampler_cpu").parent) == _get_build_directory(name, False)
