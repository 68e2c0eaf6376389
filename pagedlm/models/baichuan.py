"""Baichuan-7B (and Baichuan2-7B): Llama with q/k/v fused in the checkpoint.

    model.layers.N.self_attn.W_pack.weight   [3 * hidden, hidden] = [q; k; v] rows

W_pack is split into q_proj / k_proj / v_proj as the tensors stream in, so each shard goes
through the same per-rank loader as Llama's. No GQA: the three parts are equal. RoPE only:
the ALiBi 13B models are rejected when their config is read (`remote_configs`).

Baichuan2 normalizes each lm_head row at inference ("NormHead"); it is recognised by its
vocabulary of 125696 tokens (Baichuan-7B has 64000) and normalized once at load time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedlm.models.llama import LlamaForCausalLM

_BAICHUAN2_VOCAB_SIZE = 125696


class BaichuanForCausalLM(LlamaForCausalLM):
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
