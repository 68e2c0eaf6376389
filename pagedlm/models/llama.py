"""The Llama family (Llama 2/3, SmolLM, Mistral, Qwen2) written for paged attention.

All tokens of a step arrive flattened: `input_ids` and `positions` are [num_tokens];
there is no batch dimension and no padding. HF parameter names are kept, except that
q/k/v and gate/up are fused into one matmul each (see `load_weights`).
Sliding-window attention is applied per layer exactly where HF applies it
(`layer_sliding_windows`); the engine frees the KV blocks a uniform window leaves behind.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.layers.activation import SiluAndMul
from pagedlm.layers.attention import Attention
from pagedlm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from pagedlm.layers.norm import RMSNorm
from pagedlm.layers.rotary import RotaryEmbedding


def layer_sliding_windows(config) -> list[int | None]:
    """The attention window of each layer, None for full attention, as HF transformers has it.

    * Mistral, Mixtral, Phi-3: `sliding_window` (None: off) on every layer. Their HF
      models ignore `layer_types`; a config without the field (Llama) has no window.
    * Qwen2, Qwen3 (configs with `use_sliding_window`): only if `use_sliding_window`, on the
      layers `layer_types` marks "sliding_attention"; configs without `layer_types` get
      HF's default for it: layers i >= `max_window_layers`.
    """
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * n
    if not hasattr(config, "use_sliding_window"):
        return [window] * n
    if not config.use_sliding_window:
        return [None] * n
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        first = getattr(config, "max_window_layers", 28)  # HF's default
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return [window if t == "sliding_attention" else None for t in layer_types]


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, backend, qkv_bias: bool, o_bias: bool,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_kv_heads, bias=qkv_bias)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=o_bias)
        self.rotary_emb = rotary
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, backend,
                              sliding_window=sliding_window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, meta)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(o.reshape(num_tokens, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, backend, qkv_bias: bool, o_bias: bool,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, backend, qkv_bias, o_bias, sliding_window)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual, meta):
        # The residual stream is carried separately so each norm can add it in place.
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, backend, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary, backend, qkv_bias, o_bias, window)
            for window in layer_sliding_windows(config)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name -> (our fused parameter, shard id)
    stacked_params = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, config, backend, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        qkv_bias, o_bias = self.attention_biases(config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = RotaryEmbedding(config, head_dim, max_position, dtype)
        self.model = LlamaModel(config, rotary, backend, qkv_bias, o_bias)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()  # [num_tokens, vocab_size]

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def _fused_name(self, name: str) -> tuple[str, str | int | None]:
        for fused, part, shard_id in self.stacked_params:
            if f".{part}." in name:
                return name.replace(part, fused), shard_id
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our parameters; returns our parameter names filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        tied = getattr(self.config, "tie_word_embeddings", False)
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
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


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return True, False
