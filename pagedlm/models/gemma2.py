"""Gemma 2, and the Gemma pieces Gemma 3 reuses.

Differences from Llama that matter here:
  * embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype first (as HF);
  * `GemmaRMSNorm` scales by (1 + w), in float32, before casting back: checkpoints store w
    around 0 (llama.cpp's GGUF stores 1 + w; its loader subtracts the 1 again);
  * every block is a "sandwich": norms before *and* after attention and the MLP
        h = x + post_attention_norm(attn(input_norm(x)))
        y = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))
  * the MLP is GeGLU with the tanh approximation of gelu;
  * the attention scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
  * attention scores are soft-capped, cap * tanh(s / cap), and so are the final logits;
  * layers alternate sliding-window (even indices) and global attention; `layer_types`
    in the config, when present, says which is which.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.layers.attention import Attention
from pagedlm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedlm.layers.rotary import RotaryEmbedding
from pagedlm.models.llama import LlamaForCausalLM

SLIDING = "sliding_attention"
FULL = "full_attention"


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_types_of(config, default_pattern: int) -> list[str]:
    """Per-layer attention kind. transformers >= 4.53 writes `layer_types`; older configs
    have a pattern instead (every `pattern`-th layer global, the others sliding)."""
    types = getattr(config, "layer_types", None)
    if types:
        if len(types) != config.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(types)} entries but num_hidden_layers is {config.num_hidden_layers}"
            )
        unknown = set(types) - {SLIDING, FULL}
        if unknown:
            raise ValueError(f"layer_types has unsupported kinds {sorted(unknown)}; expected {SLIDING!r}, {FULL!r}")
        return list(types)
    pattern = getattr(config, "sliding_window_pattern", None) or default_pattern
    return [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight), computed in float32 (HF's Gemma2/Gemma3RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x)), gate and up fused in one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {activation!r} is not supported; expected 'gelu_pytorch_tanh'")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # each [num_tokens, intermediate / tp]
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma2Attention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, backend, sliding_window: int | None,
                 logits_soft_cap: float | None) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_kv_heads, bias=bias)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=bias)
        self.rotary_emb = rotary
        scale = config.query_pre_attn_scalar ** -0.5
        self.attn = Attention(self.num_heads, self.head_dim, scale, self.num_kv_heads, backend,
                              sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(num_tokens, self.num_heads, self.head_dim),  # [num_tokens, num_heads, head_dim]
                k.view(num_tokens, self.num_kv_heads, self.head_dim),  # [num_tokens, num_kv_heads, head_dim]
                v.view(num_tokens, self.num_kv_heads, self.head_dim))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self._qkv(x)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, meta)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(o.reshape(x.shape[0], self.q_size))


class GemmaDecoderLayer(nn.Module):
    """The sandwich block shared by Gemma 2 and 3; the attention module is passed in."""

    def __init__(self, config, self_attn: nn.Module) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = self_attn
        self.mlp = GemmaMLP(hidden, config.intermediate_size, config.hidden_activation)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), meta))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaModel(nn.Module):
    def __init__(self, config, layers: list[nn.Module], dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # HF rounds the scale to the model dtype first (sqrt(640) is not exact in bf16);
        # multiplying by that value as a Python float gives the same products.
        self.embed_scale = float(torch.tensor(math.sqrt(config.hidden_size), dtype=dtype))
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        x = x * self.embed_scale
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.norm(x)


class GemmaForCausalLMBase(LlamaForCausalLM):
    """Shared head: tied LM head by default, optional final logit soft-cap. Weight loading
    (HF names, q/k/v and gate/up fused) is Llama's."""

    def __init__(self, config, model: GemmaModel) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = model
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head.tie_to(self.model.embed_tokens)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states).float()  # [num_tokens, vocab_size]
        cap = self.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma2ForCausalLM(GemmaForCausalLMBase):
    def __init__(self, config, backend, max_position: int, dtype: torch.dtype) -> None:
        rotary = RotaryEmbedding(config, head_dim_of(config), max_position, dtype)
        soft_cap = getattr(config, "attn_logit_softcapping", None) or None
        layers = [
            GemmaDecoderLayer(config, Gemma2Attention(
                config, rotary, backend, config.sliding_window if kind == SLIDING else None, soft_cap))
            for kind in layer_types_of(config, default_pattern=2)
        ]
        super().__init__(config, GemmaModel(config, layers, dtype))
