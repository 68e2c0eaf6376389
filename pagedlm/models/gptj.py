"""GPT-J written for paged attention.

One LayerNorm per block feeds attention and MLP in parallel:
    x = x + attn(ln_1(x)) + mlp(ln_1(x))
Rotary covers the first `rotary_dim` dims of each head in the interleaved (rotate_every_two)
layout. q/k/v (no bias) are fused into one matmul; the LM head has a bias. HF parameter
names are kept, except `attn.{q,k,v}_proj` -> `attn.qkv_proj`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.layers.attention import Attention
from pagedlm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedlm.layers.parallel_state import all_gather_last_dim
from pagedlm.layers.rotary import RotaryEmbedding
from pagedlm.models.gpt_neox import gelu_fn, load_named_weights


class ParallelLMHeadWithBias(ParallelLMHead):
    """LM head whose bias is split over the vocab like its weight."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.bias = nn.Parameter(torch.empty(self.shard_size), requires_grad=False)
        self.bias.weight_loader = self.bias_loader

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape != (self.num_embeddings,):
            raise ValueError(f"shape mismatch for lm_head bias: expected ({self.num_embeddings},), "
                             f"checkpoint {tuple(loaded.shape)}")
        shard = loaded[self.vocab_start : self.vocab_end]
        param.data[: shard.shape[0]].copy_(shard)
        param.data[shard.shape[0] :].zero_()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(hidden_states, self.bias)  # [num_tokens, shard_size]
        if self.tp_size > 1:
            logits = all_gather_last_dim(logits)
        return logits[..., : self.num_embeddings]


class GPTJAttention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, backend) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        self.head_dim = hidden // total_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_heads, bias=False)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.q_size = self.num_heads * self.head_dim
        self.out_proj = RowParallelLinear(hidden, hidden, bias=False)
        self.rotary_emb = rotary
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_heads, backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, 3 * q_size]
        q, k, v = (t.view(num_tokens, self.num_heads, self.head_dim) for t in qkv.split(self.q_size, dim=-1))
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, meta)  # [num_tokens, num_heads, head_dim]
        return self.out_proj(o.reshape(num_tokens, self.q_size))


class GPTJMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        intermediate = config.n_inner or 4 * config.hidden_size
        self.fc_in = ColumnParallelLinear(config.hidden_size, intermediate, bias=True)
        self.fc_out = RowParallelLinear(intermediate, config.hidden_size, bias=True)
        self.act = gelu_fn(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


class GPTJBlock(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, backend) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = GPTJAttention(config, rotary, backend)
        self.mlp = GPTJMLP(config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x [num_tokens, hidden_size] is the residual stream
        h = self.ln_1(x)
        return x + self.attn(positions, h, meta) + self.mlp(h)


class GPTJModel(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, backend) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList(GPTJBlock(config, rotary, backend) for _ in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.wte(input_ids)  # [num_tokens, hidden_size]
        for block in self.h:
            x = block(positions, x, meta)
        return self.ln_f(x)


class GPTJForCausalLM(nn.Module):
    def __init__(self, config, backend, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        head_dim = config.hidden_size // config.num_attention_heads
        # GPT-J's base is fixed at 10000 (the config has no rope_theta); rotary_dim None = whole head.
        rotary = RotaryEmbedding(config, head_dim, max_position, dtype,
                                 rotary_dim=config.rotary_dim or head_dim, interleaved=True)
        self.transformer = GPTJModel(config, rotary, backend)
        self.lm_head = ParallelLMHeadWithBias(config.vocab_size, config.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.transformer(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()  # [num_tokens, vocab_size]

    def attention_layers(self) -> list[Attention]:
        return [block.attn.attn for block in self.transformer.h]

    @staticmethod
    def _split(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor, str | None]] | None:
        if name.endswith(("attn.bias", "attn.masked_bias", "embed_positions")):
            return None  # causal-mask and sinusoid buffers of old checkpoints
        for shard in "qkv":
            if f".attn.{shard}_proj." in name:
                return [(name.replace(f"{shard}_proj", "qkv_proj"), tensor, shard)]
        return [(name, tensor, None)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our parameters; returns our parameter names filled."""
        return load_named_weights(self, weights, self._split)
