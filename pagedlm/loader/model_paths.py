"""Where a model named on the command line is on this machine: the embedded default
(fetched into the cache on first use), a Hugging Face repo id (a snapshot in the hub's
cache), a model Ollama pulled, or a path as given. Light to import (no torch, no
transformers): `pagedlm serve` resolves the model, fetching it if need be, before it starts
the engine core's process."""

from __future__ import annotations

import functools
import os
import re

from pagedlm.loader import ollama
from pagedlm.loader.default_model import default_model_path

# A Hugging Face repo id: "org/name" (what people type), not a path that exists here.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What the engine reads from a repo: weights, configs, tokenizer, chat template. Never
# pickled *.bin/*.pt, never a repo's other GGUF quantisations or images.
HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model", "spiece.model", "*.tiktoken",
             "*.jinja", "*.txt"]


@functools.lru_cache(maxsize=16)
def hub_snapshot(repo_id: str, revision: str | None = None) -> str:
    """The local snapshot of a Hugging Face model repo (only HUB_FILES), through
    huggingface_hub: its cache (HF_HOME), HF_TOKEN, and offline mode (HF_HUB_OFFLINE=1:
    the cache only). ValueError, naming the fix, when it cannot be had."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = repo_id + (f" (revision {revision})" if revision else "")
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES)
    except GatedRepoError:
        raise ValueError(f"model {what} is gated on the Hugging Face hub: accept its terms on "
                         f"huggingface.co and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ValueError(f"model {what}: no such repository on the Hugging Face hub (or it is "
                         f"private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ValueError(f"model {repo_id}: no revision {revision!r} on the Hugging Face "
                         f"hub") from None
    except LocalEntryNotFoundError:
        raise ValueError(
            f"model {what} is not in the Hugging Face cache and the hub cannot be reached "
            f"(offline, or HF_HUB_OFFLINE=1); on a connected machine run `huggingface-cli "
            f"download {repo_id}` with the same HF_HOME, or pass a local directory") from None


def local_model_path(model: str | None, revision: str | None = None) -> str:
    """The file or directory `model` is here (None: the embedded default model, fetched on
    first use); a repo id "org/name" that is not a path here resolves through the hub's
    cache at `revision`. Paths that exist nowhere are returned as given, for the loader to
    report."""
    if model is None:
        return default_model_path()
    if model.startswith(ollama.PREFIX):  # a GGUF blob in Ollama's store: no .gguf suffix
        return ollama.resolve(model)
    if not os.path.exists(model) and _REPO_ID.match(model):
        return hub_snapshot(model, revision)
    return model
