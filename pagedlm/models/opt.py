"""OPT written for paged attention.

Tokens arrive flattened (`input_ids`, `positions`: [num_tokens]). OPT's learned position
table has two extra leading rows: position p reads row p + 2. Layers are pre-LN
(`do_layer_norm_before`, most sizes) or post-LN (OPT-350m). When `word_embed_proj_dim`
differs from `hidden_size`, token embeddings are projected in (`project_in`) and the final
hidden states projected back (`project_out`) before the tied LM head. q/k/v are fused
into one matmul (`qkv_proj`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.layers.attention import Attention
from pagedlm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
)
from pagedlm.models.gpt2 import get_activation

POSITION_OFFSET = 2


class OPTAttention(nn.Module):
    def __init__(self, config, backend) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        self.head_dim = hidden // total_heads
        bias = getattr(config, "enable_bias", True)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_heads, bias=bias)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.q_size = self.num_heads * self.head_dim
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_heads, backend)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, 3 * q_size]
        q, k, v = (t.view(num_tokens, self.num_heads, self.head_dim) for t in qkv.chunk(3, dim=-1))
        o = self.attn(q, k, v, meta)  # [num_tokens, num_heads, head_dim]
        return self.out_proj(o.reshape(num_tokens, self.q_size))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config, backend) -> None:
        super().__init__()
        hidden = config.hidden_size
        bias = getattr(config, "enable_bias", True)
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        self.pre_norm = config.do_layer_norm_before
        self.self_attn = OPTAttention(config, backend)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(hidden, config.ffn_dim, bias=bias)
        self.fc2 = RowParallelLinear(config.ffn_dim, hidden, bias=bias)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.act = get_activation(config.activation_function)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.self_attn(self.self_attn_layer_norm(x), meta)
            return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))
        x = self.self_attn_layer_norm(x + self.self_attn(x, meta))
        return self.final_layer_norm(x + self.fc2(self.act(self.fc1(x))))


class OPTDecoder(nn.Module):
    def __init__(self, config, backend) -> None:
        super().__init__()
        hidden, proj_dim = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, proj_dim)
        # Replicated on every rank: it is small and indexed by position, not by token.
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, hidden)
        self.project_in = ReplicatedLinear(proj_dim, hidden, bias=False) if proj_dim != hidden else None
        self.project_out = ReplicatedLinear(hidden, proj_dim, bias=False) if proj_dim != hidden else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config, backend) for _ in range(config.num_hidden_layers))
        self.final_layer_norm = None
        if config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False):
            affine = getattr(config, "layer_norm_elementwise_affine", True)
            self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [num_tokens, word_embed_proj_dim]
        if self.project_in is not None:
            x = self.project_in(x)  # [num_tokens, hidden_size]
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            x = layer(x, meta)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)  # [num_tokens, word_embed_proj_dim]
        return x


class OPTModel(nn.Module):
    def __init__(self, config, backend) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config, backend)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.decoder(input_ids, positions, meta)


class OPTForCausalLM(nn.Module):
    # HF checkpoint name -> (our fused parameter, shard id)
    stacked_params = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
    )

    def __init__(self, config, backend, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.model = OPTModel(config, backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.word_embed_proj_dim)
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        if self.tied:
            self.lm_head.tie_to(self.model.decoder.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()  # [num_tokens, vocab_size]

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.decoder.layers]

    def _fused_name(self, name: str) -> tuple[str, str | None]:
        for fused, part, shard_id in self.stacked_params:
            if f".{part}." in name:
                return name.replace(part, fused), shard_id
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our parameters; returns our parameter names filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("decoder."):
                name = "model." + name  # checkpoints saved from the bare OPTModel
            if self.tied and name == "lm_head.weight":
                continue
            target, shard_id = self._fused_name(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            try:
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, tensor.to(param.dtype), shard_id)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            loaded.add(target)
        return loaded
