"""Native configs for checkpoints whose config.json needs remote code (`trust_remote_code`).

Their `model_type` (internlm, aquila, baichuan, qwen) is unknown to transformers, so
`AutoConfig` refuses them. We never import or run the checkpoint's Python: instead the
fields of config.json are mapped, per architecture, onto a transformers `LlamaConfig`
carrying the standard names the engine reads (num_hidden_layers, num_attention_heads,
num_key_value_heads, hidden_size, intermediate_size, max_position_embeddings, vocab_size,
rms_norm_eps, rope_parameters, tie_word_embeddings, bos/eos ids). `architectures` is kept,
so the registry still picks the remote layout's model class.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import LlamaConfig

# LlamaConfig has defaults (e.g. eos_token_id=2) that would be wrong for other vocabularies:
# always pass the special ids explicitly, None where config.json has none.
_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _llama_like(raw: dict, **overrides) -> dict:
    """Fields shared by the checkpoints that kept Llama's config names."""
    fields = {
        "vocab_size": raw["vocab_size"],
        "hidden_size": raw["hidden_size"],
        "intermediate_size": raw["intermediate_size"],
        "num_hidden_layers": raw["num_hidden_layers"],
        "num_attention_heads": raw["num_attention_heads"],
        "num_key_value_heads": raw.get("num_key_value_heads") or raw["num_attention_heads"],
        "max_position_embeddings": raw.get("max_position_embeddings", 2048),
        "rms_norm_eps": raw.get("rms_norm_eps", 1e-6),
        "rope_theta": float(raw.get("rope_theta", 10000.0)),
        "tie_word_embeddings": raw.get("tie_word_embeddings", False),
        **{k: raw.get(k) for k in _SPECIAL_IDS},
    }
    fields.update(overrides)
    return fields


def _internlm(raw: dict) -> dict:
    """InternLM v1: Llama plus biases on q/k/v/o (`bias`, true by default in its code).
    A `rotary: {"base", "type": "dynamic"}` entry is dynamic NTK, which only changes the
    frequencies beyond max_position_embeddings, where the engine caps the context."""
    rotary = raw.get("rotary") or {}
    return _llama_like(raw, attention_bias=bool(raw.get("bias", True)),
                       rope_theta=float(rotary.get("base", raw.get("rope_theta", 10000.0))))


def _aquila(raw: dict) -> dict:
    """Aquila: the Llama layout and config names."""
    return _llama_like(raw)


def uses_alibi(raw_config: dict) -> bool:
    """Whether a Baichuan config.json is a 13B (ALiBi) one: see models/baichuan.py."""
    return "max_position_embeddings" not in raw_config


def _baichuan(raw: dict) -> dict:
    """Baichuan: Llama with a fused W_pack. The 13B models use ALiBi instead of rotary
    (`uses_alibi`: no max_position_embeddings) and size their context by
    `model_max_length`; the choice is recorded as `position_embedding`."""
    if uses_alibi(raw):
        return _llama_like(raw, max_position_embeddings=raw.get("model_max_length", 4096),
                           position_embedding="alibi")
    return _llama_like(raw, position_embedding="rope")


def _qwen(raw: dict) -> dict:
    """Original Qwen (QWenLMHeadModel). `intermediate_size` counts both SwiGLU halves, so
    the MLP width is half of it; head_dim is `kv_channels`; no GQA. `use_dynamic_ntk` and
    `use_logn_attn` only act on sequences longer than `seq_length`, so the context is capped
    there (max_position_embeddings = seq_length) and both can be ignored."""
    if float(raw.get("rotary_pct", 1.0)) != 1.0:
        raise ValueError(f"Qwen rotary_pct={raw['rotary_pct']} (partial rotary) is not supported")
    heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    if eos is None and raw["vocab_size"] > 151643:
        eos = 151643  # <|endoftext|>, which Qwen's config.json leaves to its tokenizer
    return {
        "vocab_size": raw["vocab_size"],
        "hidden_size": raw["hidden_size"],
        "intermediate_size": raw["intermediate_size"] // 2,
        "num_hidden_layers": raw["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": raw.get("kv_channels") or raw["hidden_size"] // heads,
        "max_position_embeddings": raw.get("seq_length", 2048),
        "rms_norm_eps": raw.get("layer_norm_epsilon", 1e-6),
        "rope_theta": float(raw.get("rotary_emb_base", 10000.0)),
        "tie_word_embeddings": raw.get("tie_word_embeddings", False),
        **{k: raw.get(k) for k in _SPECIAL_IDS},
        "eos_token_id": eos,
    }


# `architectures` entry -> config.json fields mapped to LlamaConfig's names
_REMOTE_CONFIGS: dict[str, Callable[[dict], dict]] = {
    "InternLMForCausalLM": _internlm,
    "AquilaForCausalLM": _aquila,
    "AquilaModel": _aquila,
    "BaichuanForCausalLM": _baichuan,
    "BaiChuanForCausalLM": _baichuan,
    "QWenLMHeadModel": _qwen,
}


def remote_config_from_dict(raw: dict):
    """A LlamaConfig for a remote-code config.json, or None when no architecture it names
    has a mapping here."""

    for arch in raw.get("architectures") or ():
        if arch in _REMOTE_CONFIGS:
            fields = _REMOTE_CONFIGS[arch](raw)
            dtype = raw.get("torch_dtype") or raw.get("dtype")
            return LlamaConfig(**fields, architectures=list(raw["architectures"]), dtype=dtype)
    return None
