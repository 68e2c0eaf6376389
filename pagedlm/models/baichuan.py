"""Baichuan (1 and 2, 7B and 13B): Llama with q/k/v fused in the checkpoint.

    model.layers.N.self_attn.W_pack.weight   [3 * hidden, hidden] = [q; k; v] rows

W_pack is split into q_proj / k_proj / v_proj as the tensors stream in, so each shard goes
through the same per-rank loader as Llama's. No GQA: the three parts are equal.

Position encoding: the 7B models use RoPE, the 13B ones (Baichuan-13B, Baichuan2-13B)
ALiBi with BLOOM's slopes, added to the scaled scores (q . k / sqrt(head_dim) + slope_h * j)
and no rotary at all. Their remote code does not choose at run time (each size ships its
own modeling file); what tells the configs apart is that the ALiBi code sizes its bias by
`model_max_length` and has no `max_position_embeddings`, which the 7B rotary code reads
(`remote_configs.uses_alibi`). vLLM keys on hidden_size == 4096 instead, which says the same for the
released checkpoints but not for resized ones. The config mapping (`remote_configs`)
records the choice as `position_embedding` ("rope" or "alibi") on the native config.

Baichuan2 normalizes each lm_head row at inference ("NormHead"); it is recognised by its
vocabulary of 125696 tokens (Baichuan-7B has 64000) and normalized once at load time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagedlm.attention.alibi import alibi_slopes
from pagedlm.layers.attention import Attention
from pagedlm.layers.parallel_state import get_tp_group
from pagedlm.models.llama import LlamaForCausalLM

_BAICHUAN2_VOCAB_SIZE = 125696


class _NoRotary(nn.Module):
    """Stands in for the rotary embedding of an ALiBi model: positions change nothing."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return q, k


class BaichuanForCausalLM(LlamaForCausalLM):
    def __init__(self, config, backend, max_position: int, dtype: torch.dtype) -> None:
        super().__init__(config, backend, max_position, dtype)
        position_embedding = getattr(config, "position_embedding", "rope")
        if position_embedding not in ("rope", "alibi"):
            raise ValueError(f"Baichuan position_embedding={position_embedding!r}: expected 'rope' or 'alibi'")
        if position_embedding == "alibi":
            self._use_alibi(backend)

    def _use_alibi(self, backend) -> None:
        """Swap each layer's rotary for nothing and its attention for one with this rank's
        ALiBi slopes (before the KV cache is bound; the layers have no other state)."""
        no_rotary = _NoRotary()
        slopes = alibi_slopes(self.config.num_attention_heads)  # [total heads]
        for layer in self.model.layers:
            attn = layer.self_attn
            first = get_tp_group().rank * attn.num_heads
            attn.rotary_emb = no_rotary
            attn.attn = Attention(attn.num_heads, attn.head_dim, attn.head_dim**-0.5, attn.num_kv_heads, backend,
                                  alibi_slopes=slopes[first : first + attn.num_heads])

    def _split_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        norm_head = self.config.vocab_size == _BAICHUAN2_VOCAB_SIZE
        for name, tensor in weights:
            if ".W_pack." in name:
                for part, chunk in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0)):
                    yield name.replace("W_pack", part), chunk
            elif norm_head and name == "lm_head.weight":
                yield name, torch.nn.functional.normalize(tensor.float(), dim=-1).to(tensor.dtype)
            else:
                yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._split_weights(weights))
