"""Models an Ollama user already pulled: ``ollama:NAME[:TAG]``, read from Ollama's store.

Ollama keeps one manifest per pulled model at
``$OLLAMA_MODELS/manifests/<registry>/<namespace>/<name>/<tag>`` (``OLLAMA_MODELS``
defaults to ``~/.ollama/models``; the registry to ``registry.ollama.ai``, the namespace to
``library``, the tag to ``latest``). It is an OCI image manifest; its layer of media type
``application/vnd.ollama.image.model`` is the GGUF file, kept as
``blobs/sha256-<hex>``. That file is loaded in place, like any GGUF file: nothing is
copied or downloaded (``ollama pull NAME`` fetches a model).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PREFIX = "ollama:"
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
DEFAULT_REGISTRY = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"


def models_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def parse_name(name: str) -> tuple[str, str, str, str]:
    """(registry, namespace, model, tag) of "model", "model:tag", "namespace/model:tag" or
    "registry/namespace/model:tag", with Ollama's defaults for what is left out."""
    path, _, tag = name.partition(":")
    parts = path.split("/")
    if not path or len(parts) > 3 or not all(parts) or ":" in tag:
        raise ValueError(f"ollama model {name!r} is not NAME, NAME:TAG or NAMESPACE/NAME:TAG")
    parts = [DEFAULT_REGISTRY, DEFAULT_NAMESPACE][: 3 - len(parts)] + parts
    return parts[0], parts[1], parts[2], tag or DEFAULT_TAG


def pulled_models(root: Path | None = None) -> list[str]:
    """The names of every model in the store, as `ollama list` shows them."""
    manifests = (root or models_dir()) / "manifests"
    names = []
    for tag_file in sorted(manifests.glob("*/*/*/*")):
        registry, namespace, model, tag = tag_file.relative_to(manifests).parts
        prefix = "" if registry == DEFAULT_REGISTRY else f"{registry}/"
        prefix += "" if namespace == DEFAULT_NAMESPACE and not prefix else f"{namespace}/"
        names.append(f"{prefix}{model}:{tag}")
    return names


def resolve(ref: str, root: Path | None = None) -> str:
    """The GGUF file of ``ollama:NAME[:TAG]`` (or of NAME[:TAG]), with an error that says
    what to do when it is not there."""
    name = ref.removeprefix(PREFIX)
    root = root or models_dir()
    registry, namespace, model, tag = parse_name(name)
    manifest = root / "manifests" / registry / namespace / model / tag
    if not manifest.is_file():
        have = pulled_models(root)
        listed = f"pulled here: {', '.join(have)}" if have else f"no model is pulled in {root}"
        raise ValueError(f"ollama model {name!r} not found ({listed}); run `ollama pull {name}` "
                         f"first, or set OLLAMA_MODELS to Ollama's models folder")
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8"))["layers"]
        digest = next(layer["digest"] for layer in layers
                      if layer.get("mediaType") == MODEL_MEDIA_TYPE)
    except (ValueError, KeyError, TypeError, StopIteration):
        raise ValueError(f"ollama manifest {manifest} names no model layer "
                         f"({MODEL_MEDIA_TYPE})") from None
    algorithm, _, hexdigest = str(digest).partition(":")
    blob = root / "blobs" / f"{algorithm}-{hexdigest}"
    if not blob.is_file():
        raise ValueError(f"ollama model {name!r}: its file {blob} is missing; run "
                         f"`ollama pull {name}` again")
    return str(blob)
