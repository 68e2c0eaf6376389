"""Kernels a parent built are imported by its tensor-parallel ranks straight from the
library files (PAGEDLM_PREBUILT_KERNELS): a rank neither hashes the sources nor builds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedlm.csrc import PREBUILT_ENV, load_all_extensions


def test_prebuilt_kernels_load_from_their_files(tmp_path):
    files = load_all_extensions()
    if "llama_decode_cpu" not in files:
        pytest.skip("the CPU kernels do not build here")
    assert "paged_attention_cpu" not in files  # bundled: the decoder's library holds it
    code = ("from pagedlm.csrc import load_extension; "
            "m = load_extension('paged_attention_cpu'); assert m.paged_decode; "
            "print(m.__file__)")
    empty = tmp_path / "kernels"  # a kernel folder with nothing in it: nothing is built there
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, PREBUILT_ENV: json.dumps(files),
                                            "PAGEDLM_KERNEL_DIR": str(empty)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == files["llama_decode_cpu"]
    assert not empty.exists()
