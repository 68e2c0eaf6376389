"""GPT-2 written for paged attention.

Tokens arrive flattened (`input_ids`, `positions`: [num_tokens]); positions index the
learned absolute position table `wpe`. HF names are kept (`transformer.h.N.attn.c_attn`,
...). HF stores GPT-2's projections as `Conv1D`, whose weight is [in, out]: it is
transposed on load into our [out, in] linear layers, and the fused `c_attn` is split
into the q/k/v shards of a tensor-parallel QKV projection.

GPT BigCode (`gpt_bigcode.py`) reuses these modules; only its `c_attn` layout and its
weight orientation differ.
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

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """HF `activation_function` name -> function (gelu_new is GELU's tanh approximation)."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation_function {name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def split_qkv_rows(tensor: torch.Tensor, q_size: int, kv_size: int,
                   interleaved_heads: int | None = None) -> dict[str, torch.Tensor]:
    """Split a fused c_attn weight ([rows, in]) or bias ([rows]) into q/k/v row blocks.

    Contiguous layout (GPT-2, MQA BigCode):   [ q (q_size) | k (kv_size) | v (kv_size) ]
    Per-head layout (non-MQA BigCode), `interleaved_heads` heads of head_dim rows each:
                                              [ q0 k0 v0 | q1 k1 v1 | ... ]
    """
    if interleaved_heads is None:
        q, k, v = tensor.split([q_size, kv_size, kv_size], dim=0)
    else:
        per_head = tensor.reshape(interleaved_heads, 3, -1, *tensor.shape[1:])  # [heads, 3, head_dim, ...]
        q, k, v = (per_head[:, i].reshape(-1, *tensor.shape[1:]) for i in range(3))
    return {"q": q, "k": k, "v": v}


class GPT2Attention(nn.Module):
    def __init__(self, config, backend, num_kv_heads: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        self.head_dim = hidden // total_heads
        self.c_attn = QKVParallelLinear(hidden, self.head_dim, total_heads, num_kv_heads, bias=True)
        self.num_heads = self.c_attn.num_heads  # this rank's
        self.num_kv_heads = self.c_attn.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True)
        scale = self.head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        self.attn = Attention(self.num_heads, self.head_dim, scale, self.num_kv_heads, backend)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.c_attn(x)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        o = self.attn(q, k, v, meta)  # [num_tokens, num_heads, head_dim]
        return self.c_proj(o.reshape(num_tokens, self.q_size))


class GPT2MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden = config.hidden_size
        inner = getattr(config, "n_inner", None) or 4 * hidden
        self.c_fc = ColumnParallelLinear(hidden, inner, bias=True)
        self.c_proj = RowParallelLinear(inner, hidden, bias=True)
        self.act = get_activation(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config, backend, num_kv_heads: int) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config, backend, num_kv_heads)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), meta)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, config, backend, num_kv_heads: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.wte = VocabParallelEmbedding(config.vocab_size, hidden)
        # Replicated on every rank: it is small and indexed by position, not by token.
        self.wpe = nn.Embedding(config.max_position_embeddings, hidden)
        self.h = nn.ModuleList(
            GPT2Block(config, backend, num_kv_heads) for _ in range(config.num_hidden_layers)
        )
        self.ln_f = nn.LayerNorm(hidden, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)  # [num_tokens, hidden_size]
        for block in self.h:
            x = block(x, meta)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    # HF's Conv1D stores [in, out]; ours are [out, in].
    conv1d_weights = True

    def __init__(self, config, backend, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.check_config(config)
        self.config = config
        self.transformer = GPT2Model(config, backend, self.num_kv_heads(config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        if self.tied:
            self.lm_head.tie_to(self.transformer.wte)

    @staticmethod
    def check_config(config) -> None:
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            raise ValueError("GPT-2 with scale_attn_by_inverse_layer_idx=True is not supported")
        if getattr(config, "reorder_and_upcast_attn", False):
            raise ValueError("GPT-2 with reorder_and_upcast_attn=True is not supported")
        if getattr(config, "add_cross_attention", False):
            raise ValueError("GPT-2 with add_cross_attention=True (an encoder-decoder) is not supported")

    @staticmethod
    def num_kv_heads(config) -> int:
        return config.num_attention_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.transformer(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()  # [num_tokens, vocab_size]

    def attention_layers(self) -> list[Attention]:
        return [block.attn.attn for block in self.transformer.h]

    def split_c_attn(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.config.hidden_size
        return split_qkv_rows(tensor, hidden, hidden)

    @staticmethod
    def _skipped(name: str) -> bool:
        # Old checkpoints carry the causal-mask buffers `attn.bias` / `attn.masked_bias`.
        return name.endswith((".attn.bias", ".attn.masked_bias"))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our parameters; returns our parameter names filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if not name.startswith(("transformer.", "lm_head.")):
                name = "transformer." + name  # checkpoints saved from the bare GPT2Model
            if self._skipped(name) or (self.tied and name == "lm_head.weight"):
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            is_proj = name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
            if self.conv1d_weights and is_proj:
                tensor = tensor.t()
            tensor = tensor.to(param.dtype)
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                if ".c_attn." in name:
                    for shard_id, part in self.split_c_attn(tensor).items():
                        loader(param, part, shard_id)
                else:
                    loader(param, tensor)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            loaded.add(name)
        return loaded
