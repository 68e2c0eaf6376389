"""Vocabulary-parallel embedding and LM head: each rank owns a contiguous vocab slice."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.layers.linear import WeightKernel
from pagedlm.layers.parallel_state import all_gather_last_dim, all_reduce, get_tp_group


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // tp.size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1] != param.shape[1]:
            raise ValueError(
                f"shape mismatch for embedding: expected ({self.num_embeddings}, {param.shape[1]}), "
                f"checkpoint {tuple(loaded.shape)}"
            )
        shard = loaded[self.vocab_start : self.vocab_end]
        param.data[: shard.shape[0]].copy_(shard)
        param.data[shard.shape[0] :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mask, input_ids - self.vocab_start, 0)
        y = F.embedding(local, self.weight) * mask.unsqueeze(-1)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits over this rank's vocab slice, then gathers."""

    # As LinearBase's: set by layers/weight_format.py; the weight is kept (it may be the
    # embedding's, tied).
    weight_kernel: WeightKernel | None = None

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight_kernel is None:
            return F.linear(x, self.weight, bias)
        return self.weight_kernel(x, bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(hidden_states, None)  # [num_tokens, shard_size]
        if self.tp_size > 1:
            logits = all_gather_last_dim(logits)
        return logits[..., : self.num_embeddings]
