"""Gemma 3 (text): Gemma 2's sandwich block with per-head q/k norms and two RoPEs.

Differences from Gemma 2 (see gemma2.py for the shared pieces):
  * `q_norm` / `k_norm` (GemmaRMSNorm over head_dim) on q and k before rotary;
  * no attention soft-capping (HF's Gemma 3 ignores `attn_logit_softcapping`); the final
    logit soft-cap applies only if the config sets one (released models do not);
  * five sliding-window layers per global one (`layer_types`, or `sliding_window_pattern`);
  * local (sliding) layers use their own RoPE base, `rope_local_base_freq` (10k), without
    scaling; global layers use `rope_theta` (1M) and `rope_scaling` (linear x8 on 4B+).
    transformers 5 keeps both in `rope_parameters` keyed by layer type.

`Gemma3ForConditionalGeneration` checkpoints (the multimodal 4B/12B/27B) load their
language model only: the vision tower and projector tensors are skipped, and the text
part of the config is used.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.layers.rotary import RotaryEmbedding
from pagedlm.models.gemma2 import (
    FULL,
    SLIDING,
    Gemma2Attention,
    GemmaDecoderLayer,
    GemmaForCausalLMBase,
    GemmaModel,
    GemmaRMSNorm,
    head_dim_of,
    layer_types_of,
)


class _RopeView:
    """The config as seen by one layer type's RoPE: `rope_parameters` is that type's flat
    dict; everything else is the real config's."""

    def __init__(self, config, params: dict) -> None:
        self._config = config
        self.rope_parameters = params

    def standardize_rope_params(self) -> None:  # already flat and complete
        pass

    def __getattr__(self, name: str):
        return getattr(self._config, name)


def rope_parameters_by_layer_type(config) -> dict[str, dict]:
    params = getattr(config, "rope_parameters", None) or {}
    if SLIDING in params or FULL in params:  # transformers >= 5
        full = dict(params.get(FULL) or {"rope_type": "default", "rope_theta": 1_000_000.0})
        local = dict(params.get(SLIDING) or {"rope_type": "default", "rope_theta": 10_000.0})
    else:  # transformers 4.x: rope_theta + rope_scaling (global), rope_local_base_freq
        full = dict(getattr(config, "rope_scaling", None) or params or {})
        full.setdefault("rope_theta", getattr(config, "rope_theta", 1_000_000.0))
        local = {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", 10_000.0)}
    for p in (full, local):
        p["rope_type"] = p.get("rope_type", p.get("type", "default")) or "default"
    return {FULL: full, SLIDING: local}


def text_config_of(config):
    """The language-model config of a multimodal Gemma 3 config; the config itself otherwise."""
    return getattr(config, "text_config", None) or config


class Gemma3Attention(Gemma2Attention):
    def __init__(self, config, rotary: RotaryEmbedding, backend, sliding_window: int | None) -> None:
        super().__init__(config, rotary, backend, sliding_window, logits_soft_cap=None)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self._qkv(x)
        q = self.q_norm(q)  # [num_tokens, num_heads, head_dim]
        k = self.k_norm(k)  # [num_tokens, num_kv_heads, head_dim]
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, meta)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(o.reshape(x.shape[0], self.q_size))


class Gemma3ForCausalLM(GemmaForCausalLMBase):
    def __init__(self, config, backend, max_position: int, dtype: torch.dtype) -> None:
        config = text_config_of(config)
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention (an embedding model) is not supported")
        head_dim = head_dim_of(config)
        rotary = {
            kind: RotaryEmbedding(_RopeView(config, params), head_dim, max_position, dtype)
            for kind, params in rope_parameters_by_layer_type(config).items()
        }
        layers = [
            GemmaDecoderLayer(config, Gemma3Attention(
                config, rotary[kind], backend, config.sliding_window if kind == SLIDING else None))
            for kind in layer_types_of(config, default_pattern=6)
        ]
        super().__init__(config, GemmaModel(config, layers, dtype))


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a multimodal Gemma 3 checkpoint; images are not supported."""

    # checkpoint prefix -> ours (transformers >= 4.52 writes the first, older ones the second)
    _PREFIXES = (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    )
    _SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")

    def _language_model_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                                ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.startswith(self._SKIPPED):
                continue
            for old, new in self._PREFIXES:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._language_model_weights(weights))
