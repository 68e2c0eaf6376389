"""BLOOM written for paged attention.

Differences from GPT-NeoX: no rotary embedding (ALiBi biases the attention scores
instead, see `pagedlm.attention.alibi`), a LayerNorm right after the word embeddings,
a tanh-approximated gelu, and optionally the residual taken *after* the layer norm
(`apply_residual_connection_post_layernorm`). The fused `query_key_value` rows are
grouped by head as in GPT-NeoX:

    HF query_key_value rows:  [ q_h0 | k_h0 | v_h0 | q_h1 | k_h1 | v_h1 | ... ]  (head_dim each)
    our QKVParallelLinear:    [ q_h0 q_h1 ... | k_h0 k_h1 ... | v_h0 v_h1 ... ]

The LM head is tied to the word embeddings. HF parameter names are kept; checkpoints
saved by the original BigScience code lack the `transformer.` prefix and get it added.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.attention.alibi import alibi_slopes
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.layers.attention import Attention
from pagedlm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedlm.layers.parallel_state import get_tp_group
from pagedlm.models.gpt_neox import load_named_weights


class BloomAttention(nn.Module):
    def __init__(self, config, backend) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.n_head
        self.head_dim = hidden // total_heads
        self.query_key_value = QKVParallelLinear(hidden, self.head_dim, total_heads, total_heads, bias=True)
        self.num_heads = self.query_key_value.num_heads  # this rank's
        self.q_size = self.num_heads * self.head_dim
        self.dense = RowParallelLinear(hidden, hidden, bias=True)
        first = get_tp_group().rank * self.num_heads
        slopes = alibi_slopes(total_heads)[first : first + self.num_heads]  # [num_heads] this rank's
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_heads, backend,
                              alibi_slopes=slopes)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.query_key_value(x)  # [num_tokens, 3 * q_size]
        q, k, v = (t.view(num_tokens, self.num_heads, self.head_dim) for t in qkv.split(self.q_size, dim=-1))
        o = self.attn(q, k, v, meta)  # [num_tokens, num_heads, head_dim]
        return self.dense(o.reshape(num_tokens, self.q_size))


class BloomMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.dense_h_to_4h = ColumnParallelLinear(hidden, 4 * hidden, bias=True)
        self.dense_4h_to_h = RowParallelLinear(4 * hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BLOOM's gelu is the tanh approximation.
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class BloomBlock(nn.Module):
    def __init__(self, config, backend) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.residual_post_layernorm = bool(config.apply_residual_connection_post_layernorm)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attention = BloomAttention(config, backend)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = BloomMLP(config)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x [num_tokens, hidden_size] is the residual stream
        h = self.input_layernorm(x)
        x = (h if self.residual_post_layernorm else x) + self.self_attention(h, meta)
        h = self.post_attention_layernorm(x)
        return (h if self.residual_post_layernorm else x) + self.mlp(h)


class BloomModel(nn.Module):
    def __init__(self, config, backend) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.word_embeddings_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.h = nn.ModuleList(BloomBlock(config, backend) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=eps)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.word_embeddings_layernorm(self.word_embeddings(input_ids))  # [num_tokens, hidden_size]
        for layer in self.h:
            x = layer(x, meta)
        return self.ln_f(x)


class BloomForCausalLM(nn.Module):
    def __init__(self, config, backend, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        del max_position, dtype  # ALiBi needs no position tables
        self.config = config
        self.num_heads = config.n_head
        self.head_dim = config.hidden_size // self.num_heads
        self.transformer = BloomModel(config, backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.lm_head.tie_to(self.transformer.word_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.transformer(input_ids, meta)  # positions only enter through ALiBi's causal distances

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()  # [num_tokens, vocab_size]

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attention.attn for layer in self.transformer.h]

    def _split(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor, str | None]] | None:
        if name == "lm_head.weight":
            return None  # tied to transformer.word_embeddings
        if not name.startswith("transformer."):
            name = "transformer." + name
        if ".query_key_value." not in name:
            return [(name, tensor, None)]
        # rows grouped by head as [q | k | v]: [num_heads * 3 * head_dim, ...] -> 3 x [num_heads * head_dim, ...]
        per_head = tensor.view(self.num_heads, 3, self.head_dim, *tensor.shape[1:])
        return [(name, per_head[:, i].reshape(self.num_heads * self.head_dim, *tensor.shape[1:]), shard)
                for i, shard in enumerate("qkv")]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our parameters; returns our parameter names filled."""
        return load_named_weights(self, weights, self._split)
