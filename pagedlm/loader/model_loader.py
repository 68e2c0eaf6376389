"""Resolve what `model=` points at, build the model class and fill its weights.

Three sources, picked once: a HuggingFace directory (config.json + *.safetensors), a
.gguf file (dequantized), or random weights of the right shapes (`load_format="dummy"`).
Whatever the source, every parameter must be filled and every shape must match.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from pagedlm.loader.dummy import init_dummy_weights
from pagedlm.loader.gguf_loader import GGUFCheckpoint
from pagedlm.loader.model_paths import local_model_path
from pagedlm.loader.safetensors_loader import count_safetensors, iterate_safetensors
from pagedlm.models.registry import resolve_model_class
from pagedlm.models.remote_configs import remote_config_from_dict

logger = logging.getLogger(__name__)


@dataclass
class ModelSource:
    path: str  # directory or .gguf file
    format: str  # "safetensors" | "gguf"
    hf_config: object  # a transformers PretrainedConfig
    gguf: object | None = None  # the opened GGUFCheckpoint, reused for weights and tokenizer


def resolve_model_source(model: str | None, revision: str | None = None) -> ModelSource:
    """A local HF directory, a .gguf file, a Hugging Face repo id ("org/name", at
    `revision`), a model Ollama pulled ("ollama:NAME[:TAG]"), or None for the embedded
    default model."""
    path = local_model_path(model, revision)
    if os.path.isfile(path) and (path.endswith(".gguf") or _has_gguf_magic(path)):
        checkpoint = GGUFCheckpoint(path)
        return ModelSource(path, "gguf", checkpoint.config, checkpoint)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model directory {path!r} has no config.json")
        from transformers import AutoConfig

        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        if "auto_map" in raw:
            logger.info("ignoring auto_map in %s: remote code is never run", path)
        try:
            hf_config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        except (ValueError, KeyError) as e:
            hf_config = _remote_config(raw, e)
        text_config = hf_config.get_text_config()
        if text_config is not hf_config:
            # A multimodal checkpoint (Gemma3ForConditionalGeneration): the engine serves its
            # language model, whose sizes live in the text config.
            text_config.architectures = hf_config.architectures
            hf_config = text_config
        return ModelSource(path, "safetensors", hf_config)
    if os.path.exists(path):
        raise ValueError(f"model {path!r} is neither a HuggingFace directory nor a .gguf file")
    raise ValueError(
        f"model {path!r} not found: not a file or directory here, nor a Hugging Face repo id "
        f"(org/name)"
    )


def _has_gguf_magic(path: str) -> bool:
    """Whether a file starts as GGUF files do (Ollama's blobs have no .gguf suffix)."""
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _remote_config(raw: dict, error: Exception):
    """A native config for a model_type transformers does not know (remote-code checkpoints),
    built from config.json alone; the registry's error when no architecture is supported."""
    config = remote_config_from_dict(raw)
    if config is not None:
        return config
    resolve_model_class(raw.get("architectures"))  # raises, listing the supported ones
    raise error  # a supported architecture with a model_type we cannot map


# The weights' progress bar appears once loading has taken this long (a big model; the
# embedded one loads in about a second and shows none).
PROGRESS_DELAY_S = 2.0


def _with_progress(weights, total: int):
    """The checkpoint's tensors, with a progress bar on stderr if loading takes a while."""
    from tqdm import tqdm

    with tqdm(weights, total=total, desc="loading weights", unit=" tensors",
              delay=PROGRESS_DELAY_S, dynamic_ncols=True) as bar:
        yield from bar


def build_model(
    source: ModelSource,
    backend,
    max_position: int,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str,
    seed: int,
) -> torch.nn.Module:
    model_cls = resolve_model_class(getattr(source.hf_config, "architectures", None))
    with torch.device(device):
        model = model_cls(source.hf_config, backend, max_position, dtype)
    model.to(dtype=dtype)
    # The rotary tables are built in float32 and cast; keep them in the model dtype.
    expected = {name for name, _ in model.named_parameters()}
    if load_format == "dummy":
        init_dummy_weights(model, seed=seed)
        return model.eval()
    if source.format == "gguf":
        weights = source.gguf.weights()
        total = len(source.gguf.tensor_infos)
    else:
        weights = iterate_safetensors(source.path)
        total = count_safetensors(source.path)
    loaded = model.load_weights(_with_progress(weights, total))
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise ValueError(
            f"checkpoint {source.path!r} did not fill {len(missing)} parameters: {shown}"
        )
    return model.eval()
