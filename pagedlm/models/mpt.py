"""MPT (MosaicML) written for paged attention, matching HF transformers' native `MptForCausalLM`.

No position embeddings: ALiBi biases the scores (see `pagedlm.attention.alibi`), but
with MPT's own slope rule (`mpt_alibi_slopes`), which differs from BLOOM's when the
head count is not a power of two. Bias-free LayerNorms and linears, a fused `Wqkv`
whose rows are [q | k | v] (hidden_size rows each, heads contiguous inside each), an
optional clamp of the fused qkv (`clip_qkv`), an exact-erf gelu MLP of width
`expansion_ratio * d_model`, and an LM head tied to `transformer.wte`.

Configs whose math we do not implement (no ALiBi, qk LayerNorm, prefix LM, sequence-id
masking, multi-query attention, linear biases, logit scaling) are rejected.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.layers.attention import Attention
from pagedlm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedlm.layers.parallel_state import get_tp_group
from pagedlm.models.gpt_neox import load_named_weights


def mpt_alibi_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> torch.Tensor:
    """[num_heads] float32 slopes by MPT's rule.

    With P the smallest power of two >= n, the P-head sequence is 2^(-max * (i + 1) / P).
    For n < P MPT takes its odd-indexed entries first, then the even-indexed ones, and
    keeps the first n (BLOOM instead rounds down and appends interleaved extras).
    Computed in float32 as MPT does, so the values are bit-identical.
    """
    if num_heads < 1:
        raise ValueError(f"num_heads must be positive, got {num_heads}")
    pow2 = 2 ** math.ceil(math.log2(num_heads))
    exponents = torch.arange(1, pow2 + 1, dtype=torch.int64).float() * (alibi_bias_max / pow2)
    slopes = 1.0 / torch.pow(2, exponents)  # [pow2] float32
    if pow2 != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes  # [num_heads]


def _attn_cfg(config, key: str, default=None):
    attn = getattr(config, "attn_config", None)
    if attn is None:
        return default
    if isinstance(attn, dict):
        return attn.get(key, default)
    return getattr(attn, key, default)


def check_mpt_config(config) -> None:
    """Raise ValueError for MPT options that change math this implementation does not have."""
    problems = []
    if not _attn_cfg(config, "alibi", True):
        problems.append("attn_config.alibi=False (learned position embeddings) is not supported; only ALiBi")
    for key in ("qk_ln", "prefix_lm", "attn_uses_sequence_id"):
        if _attn_cfg(config, key, False):
            problems.append(f"attn_config.{key}=True is not supported")
    attn_type = _attn_cfg(config, "attn_type", "multihead_attention")
    if attn_type != "multihead_attention":
        problems.append(f"attn_config.attn_type={attn_type!r} is not supported; only 'multihead_attention'")
    if not getattr(config, "no_bias", True):
        problems.append("no_bias=False (linear and LayerNorm biases) is not supported")
    if getattr(config, "logit_scale", None) is not None:
        problems.append("logit_scale is not supported")
    if problems:
        raise ValueError("unsupported MPT config: " + "; ".join(problems))


class MptAttention(nn.Module):
    def __init__(self, config, backend) -> None:
        super().__init__()
        hidden = config.d_model
        total_heads = config.n_heads
        self.head_dim = hidden // total_heads
        self.Wqkv = QKVParallelLinear(hidden, self.head_dim, total_heads, total_heads, bias=False)
        self.num_heads = self.Wqkv.num_heads  # this rank's
        self.q_size = self.num_heads * self.head_dim
        self.out_proj = RowParallelLinear(hidden, hidden, bias=False)
        clip = _attn_cfg(config, "clip_qkv")
        self.clip_qkv = float(clip) if clip else None  # MPT skips the clamp for 0 / None
        scale = _attn_cfg(config, "softmax_scale")
        scale = float(scale) if scale is not None else 1.0 / math.sqrt(hidden / total_heads)
        first = get_tp_group().rank * self.num_heads
        slopes = mpt_alibi_slopes(total_heads, float(_attn_cfg(config, "alibi_bias_max", 8)))
        slopes = slopes[first : first + self.num_heads]  # this rank's
        self.attn = Attention(self.num_heads, self.head_dim, scale, self.num_heads, backend, alibi_slopes=slopes)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.Wqkv(x)  # [num_tokens, 3 * q_size]
        if self.clip_qkv is not None:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = (t.view(num_tokens, self.num_heads, self.head_dim) for t in qkv.split(self.q_size, dim=-1))
        o = self.attn(q, k, v, meta)  # [num_tokens, num_heads, head_dim]
        return self.out_proj(o.reshape(num_tokens, self.q_size))


class MptMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden = config.d_model
        inner = int(config.expansion_ratio * hidden)
        self.up_proj = ColumnParallelLinear(hidden, inner, bias=False)
        self.down_proj = RowParallelLinear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))  # exact (erf) gelu


class MptBlock(nn.Module):
    def __init__(self, config, backend) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.norm_1 = nn.LayerNorm(config.d_model, eps=eps, bias=False)
        self.attn = MptAttention(config, backend)
        self.norm_2 = nn.LayerNorm(config.d_model, eps=eps, bias=False)
        self.ffn = MptMLP(config)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x [num_tokens, d_model] is the residual stream
        x = x + self.attn(self.norm_1(x), meta)
        return x + self.ffn(self.norm_2(x))


class MptModel(nn.Module):
    def __init__(self, config, backend) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(MptBlock(config, backend) for _ in range(config.n_layers))
        self.norm_f = nn.LayerNorm(config.d_model, eps=config.layer_norm_epsilon, bias=False)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.wte(input_ids)  # [num_tokens, d_model]
        for block in self.blocks:
            x = block(x, meta)
        return self.norm_f(x)


class MptForCausalLM(nn.Module):
    def __init__(self, config, backend, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        del max_position, dtype  # ALiBi needs no position tables
        check_mpt_config(config)
        self.config = config
        self.hidden = config.d_model
        self.transformer = MptModel(config, backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.d_model)
        self.lm_head.tie_to(self.transformer.wte)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.transformer(input_ids, meta)  # positions only enter through ALiBi's causal distances

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()  # [num_tokens, vocab_size]

    def attention_layers(self) -> list[Attention]:
        return [block.attn.attn for block in self.transformer.blocks]

    def _split(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor, str | None]] | None:
        if name == "lm_head.weight":
            return None  # tied to transformer.wte
        if not name.startswith("transformer."):
            name = "transformer." + name
        if not name.endswith(".attn.Wqkv.weight"):
            return [(name, tensor, None)]
        # rows are [q | k | v], d_model each
        return [(name, part, shard) for part, shard in zip(tensor.split(self.hidden, dim=0), "qkv")]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our parameters; returns our parameter names filled."""
        return load_named_weights(self, weights, self._split)
