"""Falcon (HF-native `FalconForCausalLM`) written for paged attention.

Two decoder layouts share one attention and one MLP:

    new_decoder_architecture (Falcon-40B/180B, 11B):  GQA with config.num_kv_heads;
        x + attn(ln_attn(x)) + mlp(ln_mlp(x))        (one shared `input_layernorm` when
                                                       num_ln_in_parallel_attn == 1)
    old layout (Falcon-7B/1B, RW):  multi_query -> 1 KV head, else one per query head;
        parallel_attn:  x + attn(ln(x)) + mlp(ln(x))  with ln = input_layernorm
        serial:         h = x + attn(input_layernorm(x)); h + mlp(post_attention_layernorm(h))

The fused `query_key_value` rows are grouped per KV head, each group holding that KV
head's query heads followed by its key and value (head_dim rows each):

    HF rows:  [ q_0 .. q_{g-1} k_0 v_0 | q_g .. q_{2g-1} k_1 v_1 | ... ]   g = heads / kv_heads
    ours:     [ q_0 q_1 ... q_{heads-1} | k_0 k_1 ... | v_0 v_1 ... ]

All three layouts are this picture: multi-query is one group of g = heads, the old
multi-head layout is heads groups of g = 1 (per head [q | k | v], as in GPT-NeoX).
Query head h reads KV head h // g in both. Rotary is rotate-half over the whole head.

Falcon-RW (`alibi=True`, e.g. falcon-rw-1b) has no rotary; ALiBi biases the scores
instead, as HF's FalconModel (and the original RW code) computes it:

    scores = (q . k + slope_h * j) / sqrt(head_dim)      slope_h rounded to bfloat16

i.e. the bias is added *before* the softmax scale, so our slopes are BLOOM's, rounded
to bf16, times 1 / sqrt(head_dim). HF also rounds each product slope_h * j to bf16;
that rounding depends on the absolute position j and cannot be reproduced by a relative
bias slope_h * (j - i). Where the slopes are powers of two (e.g. 8 heads) and j < 256
both are exact; otherwise (e.g. falcon-rw-1b's 32 heads) our bias differs from HF's by
up to 2^-8 of its size. (HF's eager attention adds the bias twice, once more in the
mask; we follow its SDPA path and the original code.)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedlm.attention.alibi import alibi_slopes
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.layers.attention import Attention
from pagedlm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedlm.layers.parallel_state import get_tp_group
from pagedlm.layers.rotary import RotaryEmbedding
from pagedlm.models.gpt_neox import gelu_fn, load_named_weights


def falcon_num_kv_heads(config) -> int:
    """KV heads the checkpoint holds. FalconConfig's `num_kv_heads` defaults to
    num_attention_heads and is ignored by the old multi-query layout (which has one)."""
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


def falcon_alibi_slopes(num_heads: int, head_dim: int) -> torch.Tensor:
    """[num_heads] float32: BLOOM's slopes rounded to bf16 (as HF Falcon rounds them),
    times the softmax scale, which HF applies to the bias too."""
    return alibi_slopes(num_heads).bfloat16().float() * head_dim**-0.5


class FalconAttention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding | None, backend) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        self.head_dim = hidden // total_heads
        self.query_key_value = QKVParallelLinear(hidden, self.head_dim, total_heads, falcon_num_kv_heads(config),
                                                 bias=config.bias)
        self.num_heads = self.query_key_value.num_heads  # this rank's
        self.num_kv_heads = self.query_key_value.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.dense = RowParallelLinear(hidden, hidden, bias=config.bias)
        self.rotary_emb = rotary  # None with ALiBi
        slopes = None
        if getattr(config, "alibi", False):
            first = get_tp_group().rank * self.num_heads
            slopes = falcon_alibi_slopes(total_heads, self.head_dim)[first : first + self.num_heads]
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, backend,
                              alibi_slopes=slopes)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # The engine sizes the cache from config.num_key_value_heads; a cache with more KV
        # heads than we write would silently broadcast (multi-query) instead of failing.
        assert self.attn.k_cache is None or self.attn.k_cache.shape[2] == self.num_kv_heads, (
            f"KV cache has {self.attn.k_cache.shape[2]} KV heads, Falcon attention has {self.num_kv_heads}"
        )
        num_tokens = x.shape[0]
        qkv = self.query_key_value(x)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, meta)  # [num_tokens, num_heads, head_dim]
        return self.dense(o.reshape(num_tokens, self.q_size))


class FalconMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        ffn = config.ffn_hidden_size or 4 * config.hidden_size
        self.dense_h_to_4h = ColumnParallelLinear(config.hidden_size, ffn, bias=config.bias)
        self.dense_4h_to_h = RowParallelLinear(ffn, config.hidden_size, bias=config.bias)
        self.act = gelu_fn(config.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class FalconDecoderLayer(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding | None, backend) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.self_attention = FalconAttention(config, rotary, backend)
        self.mlp = FalconMLP(config)
        if config.new_decoder_architecture:
            num_ln = config.num_ln_in_parallel_attn or 2
            if num_ln == 2:
                self.ln_attn = nn.LayerNorm(hidden, eps=eps)
                self.ln_mlp = nn.LayerNorm(hidden, eps=eps)
                self._forward = self._forward_two_ln
            elif config.parallel_attn:
                self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
                self._forward = self._forward_parallel
            else:
                raise ValueError("Falcon new_decoder_architecture with num_ln_in_parallel_attn=1 needs parallel_attn")
        elif config.parallel_attn:
            self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
            self._forward = self._forward_parallel
        else:
            self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
            self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)
            self._forward = self._forward_serial

    # x [num_tokens, hidden_size] is the residual stream
    def _forward_two_ln(self, positions, x, meta):
        return x + self.self_attention(positions, self.ln_attn(x), meta) + self.mlp(self.ln_mlp(x))

    def _forward_parallel(self, positions, x, meta):
        h = self.input_layernorm(x)
        return x + self.self_attention(positions, h, meta) + self.mlp(h)

    def _forward_serial(self, positions, x, meta):
        x = x + self.self_attention(positions, self.input_layernorm(x), meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self._forward(positions, x, meta)


class FalconModel(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding | None, backend) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList(FalconDecoderLayer(config, rotary, backend) for _ in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.word_embeddings(input_ids)  # [num_tokens, hidden_size]
        for layer in self.h:
            x = layer(positions, x, meta)
        return self.ln_f(x)


class FalconForCausalLM(nn.Module):
    def __init__(self, config, backend, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = falcon_num_kv_heads(config)
        self.head_dim = config.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        # FalconConfig has no `num_key_value_heads` (the engine's KV-cache sizing field) and
        # its `num_kv_heads` is wrong for multi-query: publish the true count on the config.
        published = getattr(config, "num_key_value_heads", None)
        assert published in (None, self.num_kv_heads), (
            f"config.num_key_value_heads={published} but Falcon uses {self.num_kv_heads} KV heads"
        )
        config.num_key_value_heads = self.num_kv_heads
        rotary = None if getattr(config, "alibi", False) else RotaryEmbedding(config, self.head_dim, max_position, dtype)
        self.transformer = FalconModel(config, rotary, backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head.tie_to(self.transformer.word_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.transformer(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()  # [num_tokens, vocab_size]

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attention.attn for layer in self.transformer.h]

    def _split(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor, str | None]] | None:
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if getattr(self.config, "tie_word_embeddings", True) and name == "lm_head.weight":
            return None
        if ".query_key_value." not in name:
            return [(name, tensor, None)]
        # [kv_heads * (group + 2) * head_dim, ...] -> q [heads * head_dim, ...], k, v [kv_heads * head_dim, ...]
        group = self.num_heads // self.num_kv_heads
        rest = tensor.shape[1:]
        grouped = tensor.view(self.num_kv_heads, group + 2, self.head_dim, *rest)
        return [
            (name, grouped[:, :group].reshape(self.num_heads * self.head_dim, *rest), "q"),
            (name, grouped[:, group].reshape(self.num_kv_heads * self.head_dim, *rest), "k"),
            (name, grouped[:, group + 1].reshape(self.num_kv_heads * self.head_dim, *rest), "v"),
        ]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our parameters; returns our parameter names filled."""
        return load_named_weights(self, weights, self._split)
