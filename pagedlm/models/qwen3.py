"""Qwen3 (dense): Llama with a per-head RMSNorm on q and k, applied before rotary.

Differences from Llama that matter here:
  * `q_norm` / `k_norm` normalise each head over head_dim (weights of shape [head_dim]);
  * `head_dim` is explicit in the config and may differ from hidden_size / num_heads;
  * `attention_bias` switches the bias of q/k/v *and* o projections (default False).
Sliding-window layers (`use_sliding_window`, `layer_types` / `max_window_layers`) get their
window exactly as in HF (`layer_sliding_windows`).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.layers.norm import RMSNorm
from pagedlm.layers.rotary import RotaryEmbedding
from pagedlm.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    layer_sliding_windows,
)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Qwen3Attention(LlamaAttention):
    def __init__(self, config, rotary: RotaryEmbedding, backend, qkv_bias: bool, o_bias: bool,
                 sliding_window: int | None = None) -> None:
        super().__init__(config, rotary, backend, qkv_bias, o_bias, sliding_window)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))  # [num_tokens, num_heads, head_dim]
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, meta)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(o.reshape(num_tokens, self.q_size))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    # Builds its own submodules (rather than super().__init__) so no Llama attention is
    # allocated only to be replaced; forward is Llama's.
    def __init__(self, config, rotary: RotaryEmbedding, backend, qkv_bias: bool, o_bias: bool,
                 sliding_window: int | None = None) -> None:
        nn.Module.__init__(self)
        self.self_attn = Qwen3Attention(config, rotary, backend, qkv_bias, o_bias, sliding_window)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, False)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3Model(LlamaModel):
    def __init__(self, config, rotary: RotaryEmbedding, backend, qkv_bias: bool, o_bias: bool) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, rotary, backend, qkv_bias, o_bias, window)
            for window in layer_sliding_windows(config)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """HF parameter names; q/k/v and gate/up fused as in Llama (`stacked_params`)."""

    def __init__(self, config, backend, max_position: int, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.config = config
        qkv_bias, o_bias = self.attention_biases(config)
        rotary = RotaryEmbedding(config, _head_dim(config), max_position, dtype)
        self.model = Qwen3Model(config, rotary, backend, qkv_bias, o_bias)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)
