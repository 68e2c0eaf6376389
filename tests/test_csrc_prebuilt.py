"""Kernels a parent built are imported by its ranks straight from the library files, so a
rank never takes torch's build lock (a rank killed holding it hung every later start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedlm.csrc import PREBUILT_ENV, load_all_extensions


def test_prebuilt_kernels_load_past_a_stale_build_lock():
    files = load_all_extensions()
    if "llama_decode_cpu" not in files:
        pytest.skip("the CPU kernels do not build here")
    assert "paged_attention_cpu" not in files  # bundled: the decoder's library holds it
    lock = Path(files["llama_decode_cpu"]).parent / "lock"
    assert not lock.exists()
    lock.touch()  # what a process killed inside torch's load() leaves behind
    try:
        code = ("from pagedlm.csrc import load_extension; "
                "m = load_extension('paged_attention_cpu'); assert m.paged_decode; "
                "print(m.__file__)")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, env={**os.environ, PREBUILT_ENV: json.dumps(files)})
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == files["llama_decode_cpu"]
    finally:
        lock.unlink()
