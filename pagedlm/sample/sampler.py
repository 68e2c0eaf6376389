"""One vectorised sampler for the whole batch.

Pipeline for each step (all tensor work is batched over rows):

1. Logprobs, if any row asked for them, come from the RAW logits: log_softmax of
   what the model produced, before penalties, temperature or top-k/top-p/min-p.
   This is vLLM's default "raw_logprobs" mode; the returned numbers therefore
   describe the model, not the distribution that was actually sampled from.
2. min_tokens: while a row has generated fewer than `min_tokens` tokens, its EOS
   ids (unless `ignore_eos`) and its `stop_token_ids` are set to -inf.
3. Penalties: repetition penalty over prompt + output tokens (positive logits are
   divided by it, the others multiplied), then `frequency * count` and
   `presence * (count > 0)` subtracted, counting output tokens only.
4. Greedy rows (temperature < 1e-5) take the argmax of the penalised logits.
5. Random rows: divide by temperature, apply min_p, then top-k, then top-p, and
   sample with the Gumbel-max trick using counter-based noise (see noise.py), so
   that a row's token depends only on its own seed, step and logits: not on the
   batch it shares or its position in it. On CPU a fused C++ kernel does that last
   step (cpu_sampling.py); the torch code is its reference and the GPU path.
6. Whether a row could be sampled at all: `sampled_logits` is the raw logit at each
   row's pick, finite exactly when the row holds no NaN or +inf and some finite value.
   Every pick above is an argmax in which NaN beats everything and +inf every finite
   value, and the penalties and the temperature keep NaN, +inf and -inf as they are;
   min_p, top-k and top-p keep a row's NaN or +inf too (its probabilities are then all
   NaN, which no filter masks). So one gather checks the batch, not a reduction over
   [rows, vocab]. Only a row whose EOS or stop ids min_tokens masked (one of them may be
   the bad value) is reduced: its entry is its largest raw logit.

Work no row needs is skipped; that is decided once, when the step's `SamplingBatch`
is built (sampling_batch.py). The row-wise operations of each stage are in ops.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedlm.sample.cpu_sampling import RaceFn, fused_exponential_race
from pagedlm.sample.noise import exponential_race
from pagedlm.sample.ops import (
    apply_frequency_presence_penalties,
    apply_min_p,
    apply_repetition_penalty,
    apply_top_k_top_p,
    compute_logprobs,
)
from pagedlm.sample.sampling_batch import SamplingBatch


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_reqs] int64
    # [num_reqs] float32: finite exactly where the row's logits could be sampled (stage 6)
    sampled_logits: torch.Tensor
    # The rest is None unless some row asked for logprobs. Rows that asked for fewer
    # than max_k top logprobs must be sliced by the caller.
    sampled_logprobs: torch.Tensor | None  # [num_reqs] float32, raw logprob of the sampled token
    sampled_ranks: torch.Tensor | None  # [num_reqs] int64, 1-based rank of the sampled token
    topk_token_ids: torch.Tensor | None  # [num_reqs, max_k] int64, descending logprob
    topk_logprobs: torch.Tensor | None  # [num_reqs, max_k] float32


class Sampler:
    """Turns the last-position logits of each request into one token per row.

    Does not modify `logits`. See the module docstring for the order of stages.
    use_cpu_kernels=False keeps CPU tensors on the torch path (the reference).
    """

    def __init__(self, use_cpu_kernels: bool = True) -> None:
        # The fused CPU race is built on the first CPU call rather than here: building it
        # takes a while, and a GPU engine never needs it. The process caches it.
        self.use_cpu_kernels = use_cpu_kernels

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape != (batch.num_reqs, batch.vocab_size):
            raise ValueError(
                f"logits must have shape [{batch.num_reqs}, {batch.vocab_size}], "
                f"got {list(logits.shape)}"
            )
        raw = logits.to(torch.float32)  # [num_reqs, vocab]
        x = raw
        if batch.min_tokens_rows is not None:
            x = x.index_put(
                (batch.min_tokens_rows, batch.min_tokens_ids),
                torch.tensor(float("-inf"), device=x.device),
            )
        if batch.repetition_penalty is not None:
            assert batch.seen_mask is not None
            x = apply_repetition_penalty(x, batch.seen_mask, batch.repetition_penalty)
        if batch.output_counts is not None:
            assert batch.frequency_penalty is not None and batch.presence_penalty is not None
            x = apply_frequency_presence_penalties(
                x, batch.output_counts, batch.frequency_penalty, batch.presence_penalty
            )

        if batch.all_random:
            sampled = self._sample_random(x, batch)  # [num_reqs]
        else:
            sampled = x.argmax(dim=-1)  # [num_reqs]
            if not batch.all_greedy:
                assert batch.random_rows is not None
                rows = batch.random_rows
                sampled = sampled.index_put((rows,), self._sample_random(x[rows], batch))

        picked = self._picked_logits(raw, sampled, batch)  # [num_reqs]
        if batch.max_num_logprobs is None:
            return SamplerOutput(sampled, picked, None, None, None, None)
        lp, ranks, top_ids, top_lp = compute_logprobs(raw, sampled, batch.max_num_logprobs)
        return SamplerOutput(sampled, picked, lp, ranks, top_ids, top_lp)

    @staticmethod
    def _picked_logits(raw: torch.Tensor, sampled: torch.Tensor,
                       batch: SamplingBatch) -> torch.Tensor:
        """[num_reqs] the raw logit at each row's pick, or for a row min_tokens masked its
        largest raw logit: finite exactly where the row could be sampled (stage 6 of the
        module docstring)."""
        picked = raw.gather(1, sampled[:, None]).squeeze(1)
        if batch.min_tokens_rows is not None:  # a masked EOS or stop id may be the bad one
            rows = batch.min_tokens_rows.unique()
            # NaN if any, else +inf if any, -inf if none is finite: finite exactly as the row
            picked[rows] = raw[rows].amax(dim=-1)
        return picked

    def _race_for(self, x: torch.Tensor) -> RaceFn | None:
        """The fused kernel if it applies to x (float32 on CPU, kernel built), else None."""
        if not (self.use_cpu_kernels and x.is_cpu and x.dtype == torch.float32):
            return None
        return fused_exponential_race()

    def _sample_random(self, x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """x: [num_random, vocab] penalised logits of the random rows -> [num_random] ids."""
        assert batch.temperature is not None and batch.seeds is not None
        assert batch.steps is not None
        fused = self._race_for(x)
        top_k_top_p = batch.top_k is not None or batch.top_p is not None
        if fused is not None and batch.min_p is None and not top_k_top_p:
            # The kernel divides by the temperature itself: one pass over x instead of two.
            return fused(x, batch.seeds, batch.steps, batch.temperature)
        x = x / batch.temperature[:, None]  # [num_random, vocab]
        if batch.min_p is not None:
            x = apply_min_p(x, batch.min_p)
        if top_k_top_p:
            x = apply_top_k_top_p(x, batch.top_k, batch.top_p, max_k=batch.max_top_k)
        if fused is not None:
            return fused(x, batch.seeds, batch.steps, None)
        return exponential_race(x, batch.seeds, batch.steps)
