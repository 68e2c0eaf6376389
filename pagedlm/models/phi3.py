"""Phi-3 (mini/medium, 4k and 128k): Llama's block with fused checkpoint projections.

The checkpoint stores `qkv_proj` ([q | k | v] rows) and `gate_up_proj` ([gate | up] rows)
already fused. `load_weights` splits them back into per-projection shards and feeds them
through the tensor-parallel shard loaders, so each rank still gets its own heads.

RoPE: "default" (optionally partial, `partial_rotary_factor` < 1 rotates only the first
dims of each head, as HF does) and "longrope" (Phi-3 128k). HF switches longrope between
short and long factors per forward call (long once the sequence exceeds
`original_max_position_embeddings`). We precompute one table, so we choose once by
`max_position` (the engine's max_model_len):
  * max_model_len <= original_max_position_embeddings: short factors -- identical to HF,
    since no sequence can get long enough for HF to switch;
  * larger: long factors for every position (what HF uses for long sequences). Sequences
    shorter than original_max_position_embeddings then differ from HF, so we log a warning;
    set max_model_len <= original_max_position_embeddings for exact short-context results.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagedlm.layers.embedding import ParallelLMHead
from pagedlm.layers.rotary import compute_inv_freq, rope_parameters, rotate_half
from pagedlm.models.llama import LlamaForCausalLM, LlamaModel

logger = logging.getLogger(__name__)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Phi3RotaryEmbedding(nn.Module):
    """Rotate-half RoPE over the first `rotary_dim` dims of each head; the rest pass through."""

    def __init__(self, config, head_dim: int, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        params = rope_parameters(config)
        partial = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0)
        self.rotary_dim = int(head_dim * partial)
        if params["rope_type"] == "longrope":
            inv_freq, scaling = self._longrope(config, params, max_position)
        else:
            inv_freq, scaling = compute_inv_freq(config, head_dim, partial)
        if inv_freq.numel() * 2 != self.rotary_dim:
            raise ValueError(f"RoPE produced {inv_freq.numel()} frequencies for rotary_dim {self.rotary_dim}")
        positions = torch.arange(max_position, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, rotary_dim]
        self.register_buffer("cos_cache", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * scaling).to(dtype), persistent=False)

    @staticmethod
    def _longrope(config, params: dict, max_position: int) -> tuple[torch.Tensor, float]:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        original = params.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None)
        if original is None:
            raise ValueError("longrope needs original_max_position_embeddings in the model config")
        if max_position > original:
            logger.warning(
                "longrope: max_model_len %d > original_max_position_embeddings %d, using the long "
                "factors for all positions; sequences shorter than %d differ slightly from HF "
                "(which uses the short factors there)", max_position, original, original)
        # seq_len picks the factor set exactly as HF does for a sequence of that length.
        inv_freq, scaling = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"), seq_len=max_position)
        return inv_freq.float(), float(scaling)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # query [num_tokens, num_heads, head_dim], key [num_tokens, num_kv_heads, head_dim]
        cos = self.cos_cache[positions].unsqueeze(1)  # [num_tokens, 1, rotary_dim]
        sin = self.sin_cache[positions].unsqueeze(1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, backend, max_position: int, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Phi3ForCausalLM supports hidden_act 'silu' only, config has {act!r}")
        self.config = config
        head_dim = _head_dim(config)
        self.q_size = config.num_attention_heads * head_dim
        self.kv_size = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
        rotary = Phi3RotaryEmbedding(config, head_dim, max_position, dtype)
        # Llama's model takes any module with RotaryEmbedding's forward signature.
        self.model = LlamaModel(config, rotary, backend, qkv_bias=False, o_bias=False)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint's fused qkv_proj / gate_up_proj -> HF Llama-style per-projection tensors."""
        for name, tensor in weights:
            if ".qkv_proj." in name:
                # [q_size + 2 * kv_size, hidden] -> q, k, v
                if tensor.shape[0] != self.q_size + 2 * self.kv_size:
                    raise ValueError(f"{name}: expected {self.q_size + 2 * self.kv_size} rows, "
                                     f"checkpoint has {tuple(tensor.shape)}")
                q, k, v = tensor.split([self.q_size, self.kv_size, self.kv_size], dim=0)
                for part, shard in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    yield name.replace("qkv_proj", part), shard
            elif ".gate_up_proj." in name:
                # [2 * intermediate, hidden] -> gate, up
                if tensor.shape[0] % 2:
                    raise ValueError(f"{name}: odd number of rows {tuple(tensor.shape)}")
                gate, up = tensor.chunk(2, dim=0)
                yield name.replace("gate_up_proj", "gate_proj"), gate
                yield name.replace("gate_up_proj", "up_proj"), up
            else:
                yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Split the fused checkpoint tensors, then load as Llama (per-rank shards)."""
        return super().load_weights(self._split_fused(weights))
