"""llama.cpp architectures (a GGUF's ``general.architecture``) mapped onto transformers configs
and HF weight names, the way llama.cpp's ``convert_hf_to_gguf.py`` mapped them the other way.

Tensor names are not written out here: each spec lists the HF modules of the checkpoint a file
was converted from, and the GGUF name of each is what ``gguf.TensorNameMap`` (the converter's
own table) gives it; the inverse table is derived from that. Only what the converter does
besides renaming is spelled out per family: the Q/K row permutation (llama), norms stored as
1 + w (Gemma), Conv1D weights transposed (GPT-2), Falcon's regrouped QKV rows, the metadata
keys, and what llama.cpp hard-codes instead of writing into the file.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import gguf
import numpy as np
import torch

from pagedlm.loader.gguf_format import GGUFTensorInfo, unpermute_qk

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class GGUFCheckpointView(Protocol):
    """What the hooks below read from an open GGUF file (``gguf_loader.GGUFCheckpoint``,
    which uses this table, so the table names the checkpoint only by this interface)."""

    path: str
    architecture: str
    metadata: dict[str, Any]
    tensor_infos: dict[str, GGUFTensorInfo]

    def arch_value(self, suffix: str, default: Any = None) -> Any: ...

    def rope_parameters(self) -> dict[str, Any]: ...

    def read_array(self, gguf_name: str) -> np.ndarray: ...

    def warn(self, message: str) -> None: ...


ConfigTransform = Callable[[GGUFCheckpointView, dict[str, Any]], None]
TensorTransform = Callable[["PretrainedConfig", str, torch.Tensor], torch.Tensor]

# GGUF key suffix (after "<arch>.") -> HF config attribute, for the Llama-like families.
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
_GPT2_CONFIG_KEYS: dict[str, str] = {
    "embedding_length": "n_embd",
    "feed_forward_length": "n_inner",
    "block_count": "n_layer",
    "attention.head_count": "n_head",
    "attention.layer_norm_epsilon": "layer_norm_epsilon",
    "context_length": "n_positions",
    "vocab_size": "vocab_size",
}
_FALCON_CONFIG_KEYS: dict[str, str] = {
    "embedding_length": "hidden_size",
    "feed_forward_length": "ffn_hidden_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_kv_heads",
    "attention.layer_norm_epsilon": "layer_norm_epsilon",
    "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
}
_GEMMA_CONFIG_KEYS: dict[str, str] = {
    **_LLAMA_LIKE_CONFIG_KEYS,
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
}

# HF module paths; "{bid}" is the layer index.
_LLAMA_MODULES = (
    "model.embed_tokens", "model.norm", "lm_head",
    "model.layers.{bid}.input_layernorm", "model.layers.{bid}.post_attention_layernorm",
    "model.layers.{bid}.self_attn.q_proj", "model.layers.{bid}.self_attn.k_proj",
    "model.layers.{bid}.self_attn.v_proj", "model.layers.{bid}.self_attn.o_proj",
    "model.layers.{bid}.mlp.gate_proj", "model.layers.{bid}.mlp.up_proj",
    "model.layers.{bid}.mlp.down_proj",
)
_QK_NORM_MODULES = ("model.layers.{bid}.self_attn.q_norm", "model.layers.{bid}.self_attn.k_norm")
# Phi-3's fused projections; llama.cpp also accepts split q/k/v, which the HF model loads too.
_PHI3_MODULES = (
    *_LLAMA_MODULES[:-3], "model.layers.{bid}.self_attn.qkv_proj",
    "model.layers.{bid}.mlp.gate_up_proj", "model.layers.{bid}.mlp.down_proj",
)
# Gemma 2 always ties the LM head (llama.cpp's gemma2 has no output tensor); Gemma 3 may not.
# (post_attention_layernorm is Gemma's post-attention norm here, not the pre-MLP one.)
_GEMMA2_MODULES = (
    "model.embed_tokens", "model.norm", *_LLAMA_MODULES[3:],
    "model.layers.{bid}.pre_feedforward_layernorm", "model.layers.{bid}.post_feedforward_layernorm",
)
_GPT2_MODULES = (
    "transformer.wte", "transformer.wpe", "transformer.ln_f", "lm_head",
    "transformer.h.{bid}.ln_1", "transformer.h.{bid}.attn.c_attn", "transformer.h.{bid}.attn.c_proj",
    "transformer.h.{bid}.ln_2", "transformer.h.{bid}.mlp.c_fc", "transformer.h.{bid}.mlp.c_proj",
)
_FALCON_MODULES = (
    "transformer.word_embeddings", "transformer.ln_f", "lm_head",
    "transformer.h.{bid}.self_attention.query_key_value", "transformer.h.{bid}.self_attention.dense",
    "transformer.h.{bid}.mlp.dense_h_to_4h", "transformer.h.{bid}.mlp.dense_4h_to_h",
)


@dataclass(frozen=True)
class GGUFArchSpec:
    """How one ``general.architecture`` maps onto a transformers config and HF weight names.

    To support a new family, add an entry to ``GGUF_ARCHITECTURES`` listing the HF modules;
    a family whose converter changed values, not just names, sets ``tensor_transform``.
    """

    config_class: str  # attribute of the ``transformers`` package
    hf_architecture: str  # goes into ``config.architectures``
    hf_modules: tuple[str, ...]
    config_keys: dict[str, str]
    # Run in order on the config kwargs, for what the keys alone do not give.
    config_transforms: tuple[ConfigTransform, ...] = ()
    # GGUF tensors with no HF counterpart (e.g. llama3's precomputed rope frequency factors).
    ignored_tensors: frozenset[str] = frozenset({"rope_freqs.weight"})
    tensor_transform: TensorTransform | None = None
    # The HF modules when they depend on the file (Falcon's one or two layer norms).
    file_modules: Callable[[GGUFCheckpointView], tuple[str, ...]] | None = None

    def modules(self, ckpt: GGUFCheckpointView) -> tuple[str, ...]:
        return self.hf_modules if self.file_modules is None else self.file_modules(ckpt)


_ARCH_IDS = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}


@functools.cache
def gguf_to_hf_names(arch: str, hf_modules: tuple[str, ...]) -> dict[str, str]:
    """GGUF tensor-name template -> HF module template, both with "{bid}" for the layer, e.g.
    ``"blk.{bid}.attn_q" -> "model.layers.{bid}.self_attn.q_proj"``, from gguf's TensorNameMap."""
    tensor_map = gguf.get_tensor_name_map(_ARCH_IDS[arch], 1)
    table: dict[str, str] = {}
    for hf in hf_modules:
        name = tensor_map.get_name(hf.format(bid=0))
        assert name is not None, f"gguf's TensorNameMap has no {arch} tensor for {hf!r}"
        template = name.replace("blk.0.", "blk.{bid}.", 1)
        assert template not in table, f"{arch}: {table[template]!r} and {hf!r} are both {template!r}"
        table[template] = hf
    return table


# --------------------------------------------------------------------------------------------
# Config transforms
# --------------------------------------------------------------------------------------------


def _rotary_config(ckpt: GGUFCheckpointView, kwargs: dict[str, Any]) -> None:
    """Llama-like families: GQA head counts, head_dim, RoPE, attention biases."""
    n_head = int(kwargs["num_attention_heads"])
    kwargs.setdefault("num_key_value_heads", n_head)
    if "head_dim" not in kwargs:
        # llama.cpp omits key_length when it equals the rope dimension / the default split.
        rope_dim = ckpt.arch_value("rope.dimension_count")
        kwargs["head_dim"] = int(rope_dim) if rope_dim else int(kwargs["hidden_size"]) // n_head
    kwargs["rope_parameters"] = ckpt.rope_parameters()
    if "blk.0.attn_q.bias" in ckpt.tensor_infos:
        kwargs["attention_bias"] = True
    if "rope_freqs.weight" in ckpt.tensor_infos:
        ckpt.warn("carries llama3-style rope frequency factors (rope_freqs.weight), which the HF "
                  "config cannot express; they are ignored")


def _no_attention_bias_flag(ckpt: GGUFCheckpointView, kwargs: dict[str, Any]) -> None:
    kwargs.pop("attention_bias", None)  # Qwen2's biases are always there


def _gemma_config(ckpt: GGUFCheckpointView, kwargs: dict[str, Any]) -> None:
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
        local = {"rope_type": "default", "rope_theta": float(ckpt.arch_value("rope.freq_base_swa", 10_000.0))}
        kwargs["rope_parameters"] = {"full_attention": kwargs["rope_parameters"], "sliding_attention": local}
    tokens = ckpt.metadata.get("tokenizer.ggml.tokens") or []
    eos = kwargs.get("eos_token_id")
    if eos is not None and "<end_of_turn>" in tokens:
        end_of_turn = tokens.index("<end_of_turn>")
        kwargs["eos_token_id"] = [eos] if end_of_turn == eos else [eos, end_of_turn]


def _phi3_config(ckpt: GGUFCheckpointView, kwargs: dict[str, Any]) -> None:
    """Phi-3's converter writes the rotary dimension (``partial_rotary_factor * head_dim``), not
    the head size; a sliding window of 0 means none (Phi-4); Phi-3 128k's longrope factors
    travel as two tensors, its attention factor as ``rope.scaling.attn_factor``."""
    head_dim = int(kwargs["hidden_size"]) // int(kwargs["num_attention_heads"])
    kwargs.pop("head_dim", None)  # Phi3Config derives it; a stale one would override that
    rope_dim = ckpt.arch_value("rope.dimension_count")
    if rope_dim and int(rope_dim) != head_dim:
        kwargs["partial_rotary_factor"] = int(rope_dim) / head_dim
    kwargs["sliding_window"] = int(ckpt.arch_value("attention.sliding_window", 0)) or None
    original = int(ckpt.arch_value("rope.scaling.original_context_length", 0)) or kwargs["max_position_embeddings"]
    kwargs["original_max_position_embeddings"] = original
    if "rope_factors_long.weight" in ckpt.tensor_infos:
        rope = {
            "rope_type": "longrope",
            "rope_theta": kwargs["rope_parameters"]["rope_theta"],
            "long_factor": ckpt.read_array("rope_factors_long.weight").tolist(),
            "short_factor": ckpt.read_array("rope_factors_short.weight").tolist(),
            "original_max_position_embeddings": original,
        }
        attn_factor = ckpt.arch_value("rope.scaling.attn_factor")
        if attn_factor is not None:
            rope["attention_factor"] = float(attn_factor)
        kwargs["rope_parameters"] = rope


def _gpt2_config(ckpt: GGUFCheckpointView, kwargs: dict[str, Any]) -> None:
    # llama.cpp's starcoder always has one shared KV head; GPT-2 has as many as query heads.
    n_kv = int(ckpt.arch_value("attention.head_count_kv", kwargs["n_head"]))
    if ckpt.architecture == "starcoder":
        if n_kv != 1:
            raise ValueError(f"{ckpt.path}: starcoder GGUF with {n_kv} KV heads; only "
                             "multi-query files (1 KV head, as llama.cpp writes them) load")
        kwargs["multi_query"] = True
    elif n_kv != kwargs["n_head"]:
        raise ValueError(f"{ckpt.path}: gpt2 GGUF with {n_kv} KV heads for {kwargs['n_head']} heads")


def _falcon_config(ckpt: GGUFCheckpointView, kwargs: dict[str, Any]) -> None:
    """Falcon's decoder layout from the tensors: two layer norms (attn_norm_2 present) is the
    new architecture of Falcon-40B/180B; one norm and one KV head is Falcon-7B's multi-query
    layout; one norm and grouped KV heads is the new architecture with one norm (Falcon2-11B).
    llama.cpp runs attention and MLP in parallel and uses RoPE (no ALiBi) in every case."""
    n_head = int(kwargs["num_attention_heads"])
    n_kv = int(kwargs.setdefault("num_kv_heads", n_head))  # llama.cpp's default too
    two_norms = "blk.0.attn_norm_2.weight" in ckpt.tensor_infos
    kwargs.update(parallel_attn=True, alibi=False, bias="blk.0.attn_qkv.bias" in ckpt.tensor_infos,
                  rope_parameters=ckpt.rope_parameters())
    if two_norms or 1 < n_kv:
        kwargs.update(new_decoder_architecture=True, num_ln_in_parallel_attn=2 if two_norms else 1)
    else:
        kwargs.update(new_decoder_architecture=False, multi_query=True)
    if n_head % n_kv:
        raise ValueError(f"{ckpt.path}: {n_head} attention heads are not a multiple of {n_kv} KV heads")


def _falcon_modules(ckpt: GGUFCheckpointView) -> tuple[str, ...]:
    if "blk.0.attn_norm_2.weight" in ckpt.tensor_infos:
        norms = ("transformer.h.{bid}.ln_attn", "transformer.h.{bid}.ln_mlp")
    else:
        norms = ("transformer.h.{bid}.input_layernorm",)
    return (*_FALCON_MODULES, *norms)


# --------------------------------------------------------------------------------------------
# Tensor transforms: the inverse of what convert_hf_to_gguf.py did to the values
# --------------------------------------------------------------------------------------------


def _llama_qk(config: PretrainedConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    # llama.cpp permuted Q/K rows for its interleaved ("NORM") rope; HF rotates halves.
    if ".self_attn.q_proj." in name:
        return unpermute_qk(tensor, config.num_attention_heads)
    if ".self_attn.k_proj." in name:
        return unpermute_qk(tensor, config.num_key_value_heads)
    return tensor


def _gemma_norm(config: PretrainedConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    # HF's Gemma norms scale by (1 + w); llama.cpp's converter stores 1 + w (shifted in f32).
    return tensor - 1.0 if name.endswith("norm.weight") else tensor


def _gpt2_conv1d(config: PretrainedConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    # GPT-2's Conv1D weights are [in, out]; the converter transposed them to [out, in].
    if tensor.dim() == 2 and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
        return tensor.t().contiguous()
    return tensor


def _falcon_qkv(config: PretrainedConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """llama.cpp stores Falcon's fused QKV rows as [all q | all k | all v]; HF groups them per
    KV head, [q_0 .. q_{g-1}, k, v] for each of the KV heads (g = heads / KV heads)::

        GGUF  [ q (n_head * d) | k (n_kv * d) | v (n_kv * d) ]
        HF    [ n_kv x ( g x q (d) | k (d) | v (d) ) ]
    """
    if ".query_key_value." not in name:
        return tensor
    n_head = config.num_attention_heads
    n_kv = 1 if not config.new_decoder_architecture else config.num_kv_heads
    head_dim = config.hidden_size // n_head
    rest = tuple(tensor.shape[1:])
    q, k, v = tensor.split([n_head * head_dim, n_kv * head_dim, n_kv * head_dim])
    grouped = torch.cat((
        q.reshape(n_kv, n_head // n_kv, head_dim, *rest),
        k.reshape(n_kv, 1, head_dim, *rest),
        v.reshape(n_kv, 1, head_dim, *rest),
    ), dim=1)  # [n_kv, g + 2, head_dim, *rest]
    return grouped.reshape(tensor.shape)


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------

_GEMMA = dict(config_keys=_GEMMA_CONFIG_KEYS, config_transforms=(_rotary_config, _gemma_config),
              tensor_transform=_gemma_norm)

GGUF_ARCHITECTURES: dict[str, GGUFArchSpec] = {
    # Mistral 7B and friends are written by llama.cpp as "llama" too. The GGUF records no sliding
    # window, so they load as LlamaForCausalLM: identical weights and maths (up to v0.1's 4k
    # window, which llama.cpp does not apply either).
    "llama": GGUFArchSpec("LlamaConfig", "LlamaForCausalLM", _LLAMA_MODULES, _LLAMA_LIKE_CONFIG_KEYS,
                          (_rotary_config,), tensor_transform=_llama_qk),
    # The families below use llama.cpp's NEOX rope (rotate-half, as HF): Q/K rows untouched.
    "qwen2": GGUFArchSpec("Qwen2Config", "Qwen2ForCausalLM", _LLAMA_MODULES, _LLAMA_LIKE_CONFIG_KEYS,
                          (_rotary_config, _no_attention_bias_flag)),
    "qwen3": GGUFArchSpec("Qwen3Config", "Qwen3ForCausalLM", (*_LLAMA_MODULES, *_QK_NORM_MODULES),
                          _LLAMA_LIKE_CONFIG_KEYS, (_rotary_config,)),
    "phi3": GGUFArchSpec(
        "Phi3Config", "Phi3ForCausalLM", _PHI3_MODULES, _LLAMA_LIKE_CONFIG_KEYS,
        (_rotary_config, _phi3_config),
        ignored_tensors=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"}),
    ),
    "gemma2": GGUFArchSpec("Gemma2Config", "Gemma2ForCausalLM", _GEMMA2_MODULES, **_GEMMA),
    "gemma3": GGUFArchSpec("Gemma3TextConfig", "Gemma3ForCausalLM",
                           (*_GEMMA2_MODULES, "lm_head", *_QK_NORM_MODULES), **_GEMMA),
    "gpt2": GGUFArchSpec("GPT2Config", "GPT2LMHeadModel", _GPT2_MODULES, _GPT2_CONFIG_KEYS,
                         (_gpt2_config,), tensor_transform=_gpt2_conv1d),
    # StarCoder / SantaCoder: GPT-2's names with nn.Linear weights (nothing transposed).
    "starcoder": GGUFArchSpec("GPTBigCodeConfig", "GPTBigCodeForCausalLM", _GPT2_MODULES,
                              _GPT2_CONFIG_KEYS, (_gpt2_config,)),
    "falcon": GGUFArchSpec("FalconConfig", "FalconForCausalLM", _FALCON_MODULES, _FALCON_CONFIG_KEYS,
                           (_falcon_config,), tensor_transform=_falcon_qkv, file_modules=_falcon_modules),
}
