"""GPT-NeoX (Pythia, Dolly v2, StableLM-alpha) written for paged attention.

Differences from Llama: LayerNorm with bias, partial rotary (`rotary_pct` of each head,
rotate-half layout), a plain gelu MLP, an optional parallel residual
(x + attn(ln1(x)) + mlp(ln2(x))) and one fused `query_key_value` matrix whose rows are
grouped by head:

    HF query_key_value rows:  [ q_h0 | k_h0 | v_h0 | q_h1 | k_h1 | v_h1 | ... ]  (head_dim each)
    our QKVParallelLinear:    [ q_h0 q_h1 ... | k_h0 k_h1 ... | v_h0 v_h1 ... ]

`load_weights` regroups the rows, so the per-rank q/k/v shards are the usual contiguous ones.
HF parameter names are kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.layers.attention import Attention
from pagedlm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from pagedlm.layers.rotary import RotaryEmbedding, rope_parameters

_GELU_APPROXIMATION = {
    "gelu": "none",
    "gelu_new": "tanh",
    "gelu_fast": "tanh",
    "gelu_pytorch_tanh": "tanh",
}


def gelu_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """HF `hidden_act` / `activation_function` names of the gelu family -> function."""
    if name not in _GELU_APPROXIMATION:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(_GELU_APPROXIMATION)}")
    approximate = _GELU_APPROXIMATION[name]
    return lambda x: F.gelu(x, approximate=approximate)


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       split: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor, str | None]] | None]
                       ) -> set[str]:
    """Copy HF-named tensors into `model`'s parameters; returns our parameter names filled.

    `split(name, tensor)` maps one checkpoint tensor to [(our name, tensor, shard id)], or
    None to skip it (non-persistent buffers saved by old checkpoints)."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        parts = split(name, tensor)
        if parts is None:
            continue
        for target, part, shard_id in parts:
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
            try:
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, part.to(param.dtype), shard_id)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            loaded.add(target)
    return loaded


class GPTNeoXAttention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, backend) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        self.head_dim = hidden // total_heads
        bias = bool(getattr(config, "attention_bias", True))
        self.query_key_value = QKVParallelLinear(hidden, self.head_dim, total_heads, total_heads, bias=bias)
        self.num_heads = self.query_key_value.num_heads  # this rank's
        self.q_size = self.num_heads * self.head_dim
        self.dense = RowParallelLinear(hidden, hidden, bias=bias)
        self.rotary_emb = rotary
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_heads, backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.query_key_value(x)  # [num_tokens, 3 * q_size]
        q, k, v = (t.view(num_tokens, self.num_heads, self.head_dim) for t in qkv.split(self.q_size, dim=-1))
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, meta)  # [num_tokens, num_heads, head_dim]
        return self.dense(o.reshape(num_tokens, self.q_size))


class GPTNeoXMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.dense_4h_to_h = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = gelu_fn(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class GPTNeoXLayer(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, backend) -> None:
        super().__init__()
        self.use_parallel_residual = bool(config.use_parallel_residual)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = GPTNeoXAttention(config, rotary, backend)
        self.mlp = GPTNeoXMLP(config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x [num_tokens, hidden_size] is the residual stream
        attn = self.attention(positions, self.input_layernorm(x), meta)
        if self.use_parallel_residual:
            return x + attn + self.mlp(self.post_attention_layernorm(x))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class GPTNeoXModel(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, backend) -> None:
        super().__init__()
        self.embed_in = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GPTNeoXLayer(config, rotary, backend) for _ in range(config.num_hidden_layers))
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_in(input_ids)  # [num_tokens, hidden_size]
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.final_layer_norm(x)


def neox_rotary_dim(config, head_dim: int) -> int:
    """HF's int(head_dim * rotary_pct); 5.x keeps rotary_pct as rope_parameters' partial_rotary_factor."""
    factor = rope_parameters(config).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(config, "rotary_pct", 1.0)
    return int(head_dim * factor)


class GPTNeoXForCausalLM(nn.Module):
    def __init__(self, config, backend, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        rotary = RotaryEmbedding(config, self.head_dim, max_position, dtype,
                                 rotary_dim=neox_rotary_dim(config, self.head_dim))
        self.gpt_neox = GPTNeoXModel(config, rotary, backend)
        self.embed_out = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.embed_out.tie_to(self.gpt_neox.embed_in)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.gpt_neox(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.embed_out(hidden_states).float()  # [num_tokens, vocab_size]

    def attention_layers(self) -> list[Attention]:
        return [layer.attention.attn for layer in self.gpt_neox.layers]

    def _split(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor, str | None]] | None:
        if name.endswith(("attention.bias", "attention.masked_bias", "rotary_emb.inv_freq")):
            return None  # causal-mask and rotary buffers of old checkpoints
        if getattr(self.config, "tie_word_embeddings", False) and name == "embed_out.weight":
            return None
        if ".query_key_value." not in name:
            return [(name, tensor, None)]
        # rows grouped by head as [q | k | v]: [num_heads * 3 * head_dim, ...] -> 3 x [num_heads * head_dim, ...]
        per_head = tensor.view(self.num_heads, 3, self.head_dim, *tensor.shape[1:])
        return [(name, per_head[:, i].reshape(self.num_heads * self.head_dim, *tensor.shape[1:]), shard)
                for i, shard in enumerate("qkv")]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our parameters; returns our parameter names filled."""
        return load_named_weights(self, weights, self._split)
