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

Work no row needs is skipped; that is decided once in `make_sampling_batch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedlm.sample.cpu_sampling import RaceFn, fused_exponential_race
from pagedlm.sample.noise import exponential_race
from pagedlm.sample.noise import random_uniform as random_uniform  # re-exported
from pagedlm.sampling_params import SamplingParams

_SEED_MODULUS = 1 << 63


# ---------------------------------------------------------------------------
# Masking helpers. All are out-of-place and row-wise: row r of the result
# depends only on row r of the inputs.
# ---------------------------------------------------------------------------


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token whose probability is below min_p * (max probability).

    logits: [num_rows, vocab]; min_p: [num_rows] float32 in [0, 1] (0 = disabled).
    Done in log space: p_i < min_p * p_max  <=>  logit_i - logit_max < log(min_p),
    which needs no softmax and has no underflow at tiny temperatures.
    """
    max_logit = logits.amax(dim=-1, keepdim=True)  # [num_rows, 1]
    threshold = max_logit + torch.log(min_p.to(logits.dtype))[:, None]  # [num_rows, 1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,
    k: torch.Tensor | None,
    p: torch.Tensor | None,
    max_k: int | None = None,
) -> torch.Tensor:
    """Top-k, then top-p (over the renormalised top-k distribution), as -inf masks.

    logits: [num_rows, vocab]. k: [num_rows] int64, a value <= 0 or >= vocab
    disables top-k for that row. p: [num_rows] float32 in (0, 1], 1 disables.
    max_k: the largest enabled k, if the caller knows it on the host (avoids a
    device sync and lets top-k alone use `topk` instead of a full sort).

    Top-p keeps the smallest prefix of tokens, by descending probability, whose
    cumulative probability reaches p; always at least one token. Both filters are
    applied as a threshold on logit values, so tokens tied with the last kept
    token are kept too; that makes the mask independent of how ties are ordered.
    """
    if k is None and p is None:
        return logits
    vocab = logits.shape[-1]
    neg_inf = float("-inf")
    if k is not None:
        k_disabled = (k <= 0) | (k >= vocab)  # [num_rows]

    if p is None:
        assert k is not None
        if max_k is None:
            enabled = k.masked_fill(k_disabled, 0)
            max_k = int(enabled.max().item()) if enabled.numel() else 0
        if max_k <= 0:
            return logits
        max_k = min(max_k, vocab)
        top = logits.topk(max_k, dim=-1).values  # [num_rows, max_k], descending
        idx = (k.clamp(1, max_k) - 1)[:, None]  # [num_rows, 1]
        kth = top.gather(1, idx)  # [num_rows, 1]
        kth = kth.masked_fill(k_disabled[:, None], neg_inf)
        return logits.masked_fill(logits < kth, neg_inf)

    # Top-p needs the whole sorted row; only values are needed, never indices,
    # because the result is applied as a value threshold.
    sorted_logits = logits.sort(dim=-1, descending=True).values  # [num_rows, vocab]
    if k is not None:
        idx = (k.clamp(1, vocab) - 1)[:, None]  # [num_rows, 1]
        kth = sorted_logits.gather(1, idx).masked_fill(
            k_disabled[:, None], neg_inf
        )  # [num_rows, 1]
        # Still sorted after masking: everything below kth is a suffix.
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, neg_inf)
        logits = logits.masked_fill(logits < kth, neg_inf)
    probs = sorted_logits.softmax(dim=-1)  # [num_rows, vocab]
    cum = probs.cumsum(dim=-1)  # [num_rows, vocab]
    # Probability mass strictly before each position; shifting cum (rather than
    # cum - probs) keeps it monotone in float arithmetic.
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # [num_rows, vocab]
    p_col = p.to(probs.dtype)[:, None]  # [num_rows, 1]
    num_keep = (before < p_col).sum(dim=-1, keepdim=True).clamp(min=1)  # [num_rows, 1]
    threshold = sorted_logits.gather(1, num_keep - 1)  # [num_rows, 1]
    # p == 1 must keep everything even if rounding pushes cum past 1 early.
    threshold = threshold.masked_fill(p_col >= 1.0, neg_inf)
    return logits.masked_fill(logits < threshold, neg_inf)


def apply_repetition_penalty(
    logits: torch.Tensor, seen_mask: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """logits: [num_rows, vocab]; seen_mask: [num_rows, vocab] bool, tokens in the
    prompt or output; penalty: [num_rows] float32 (> 0, 1 = disabled).
    Seen tokens with a positive logit are divided by the penalty, others multiplied,
    so a penalty > 1 always makes a seen token less likely."""
    pen = penalty.to(logits.dtype)[:, None]  # [num_rows, 1]
    penalised = torch.where(logits > 0, logits / pen, logits * pen)  # [num_rows, vocab]
    return torch.where(seen_mask, penalised, logits)


def apply_frequency_presence_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """logits - frequency * count - presence * (count > 0), counting output tokens.

    output_counts: [num_rows, vocab] (any numeric dtype); frequency, presence: [num_rows].
    """
    counts = output_counts.to(logits.dtype)  # [num_rows, vocab]
    freq = frequency.to(logits.dtype)[:, None]  # [num_rows, 1]
    pres = presence.to(logits.dtype)[:, None]  # [num_rows, 1]
    return logits - freq * counts - pres * (counts > 0).to(logits.dtype)


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of given tokens plus the top `num_top` per row (also for prompt logprobs).

    logits: [N, vocab]; token_ids: [N] int64.
    Returns (token_logprobs [N] float32, ranks [N] int64, topk_ids [N, num_top] int64,
    topk_logprobs [N, num_top] float32). The rank is 1 + the number of tokens with a
    strictly greater logprob, so tied tokens share a rank; top-k is sorted descending.
    """
    if num_top < 0:
        raise ValueError(f"num_top must be >= 0, got {num_top}")
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [N, vocab]
    token_lp = logprobs.gather(1, token_ids.to(torch.int64)[:, None])  # [N, 1]
    ranks = (logprobs > token_lp).sum(dim=-1) + 1  # [N]
    num_top = min(num_top, logprobs.shape[-1])
    top_lp, top_ids = logprobs.topk(num_top, dim=-1)  # [N, num_top] each
    return token_lp.squeeze(1), ranks.to(torch.int64), top_ids, top_lp


# ---------------------------------------------------------------------------
# Per-step batch
# ---------------------------------------------------------------------------


@dataclass
class SamplingRequestState:
    """What the model runner passes for one row of the batch."""

    params: SamplingParams
    seed: int  # always set: the user's seed, or one drawn by the engine
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated before this step
    eos_token_ids: Sequence[int]  # model EOS ids (empty if unknown)


@dataclass
class SamplingBatch:
    """Tensors for one step, built once by `make_sampling_batch`.

    Optional tensors are None when no row needs them, and the Sampler then skips
    that stage entirely. Per-random-row tensors are indexed by position among the
    random rows (`random_rows` maps them back to batch rows).
    """

    num_reqs: int
    vocab_size: int
    device: torch.device
    all_greedy: bool
    all_random: bool
    # Batch rows that sample randomly; None when all rows do (or none do).
    random_rows: torch.Tensor | None  # [num_random] int64
    # Random rows only:
    temperature: torch.Tensor | None  # [num_random] float32
    seeds: torch.Tensor | None  # [num_random] int64, in [0, 2**63)
    steps: torch.Tensor | None  # [num_random] int64, len(output_token_ids)
    top_k: torch.Tensor | None  # [num_random] int64, 0 = disabled
    max_top_k: int  # largest enabled top_k among random rows (0 if none)
    top_p: torch.Tensor | None  # [num_random] float32
    min_p: torch.Tensor | None  # [num_random] float32
    # All rows:
    repetition_penalty: torch.Tensor | None  # [num_reqs] float32
    seen_mask: torch.Tensor | None  # [num_reqs, vocab] bool, prompt+output tokens
    frequency_penalty: torch.Tensor | None  # [num_reqs] float32
    presence_penalty: torch.Tensor | None  # [num_reqs] float32
    output_counts: torch.Tensor | None  # [num_reqs, vocab] int32
    # min_tokens: logits[min_tokens_rows[i], min_tokens_ids[i]] = -inf.
    min_tokens_rows: torch.Tensor | None  # [num_masked] int64
    min_tokens_ids: torch.Tensor | None  # [num_masked] int64
    # Largest `logprobs` in the batch; None if no row asked for logprobs.
    max_num_logprobs: int | None


def scatter_token_mask(idx: torch.Tensor, vocab_size: int, counts: bool) -> torch.Tensor:
    """[num_rows, vocab_size] counts (int32) or presence (bool) of the ids in each row of
    `idx` [num_rows, width]; entries equal to `vocab_size` are padding, scattered into one
    extra column that is then dropped, so ragged rows need no loop on the device."""
    out = torch.zeros(idx.shape[0], vocab_size + 1, dtype=torch.int32, device=idx.device)
    out.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.int32))  # [num_rows, vocab+1]
    out = out[:, :vocab_size]
    return out if counts else out > 0


def _token_mask(
    rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device, counts: bool
) -> torch.Tensor:
    """[len(rows), vocab_size] counts (int32) or presence (bool) of each row's tokens."""
    num_rows = len(rows)
    width = max((len(r) for r in rows), default=0)
    padded = [list(r) + [vocab_size] * (width - len(r)) for r in rows]
    idx = torch.tensor(padded, dtype=torch.int64, device=device).view(num_rows, width)
    return scatter_token_mask(idx, vocab_size, counts)


def make_sampling_batch(
    states: Sequence[SamplingRequestState], vocab_size: int, device: torch.device
) -> SamplingBatch:
    """Build the step's tensors on `device`. Token ids in prompts and outputs must
    be < vocab_size; EOS / stop ids outside the vocabulary are ignored (they can
    never be sampled, so there is nothing to mask)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    device = torch.device(device)
    num_reqs = len(states)
    greedy = [s.params.is_greedy for s in states]
    random_idx = [i for i, g in enumerate(greedy) if not g]
    rand_states = [states[i] for i in random_idx]
    all_greedy = not random_idx
    all_random = bool(random_idx) and len(random_idx) == num_reqs

    def f32(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    def i64(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    temperature = seeds = steps = top_k = top_p = min_p = None
    max_top_k = 0
    if rand_states:
        temperature = f32([s.params.temperature for s in rand_states])
        seeds = i64([s.seed % _SEED_MODULUS for s in rand_states])
        steps = i64([len(s.output_token_ids) for s in rand_states])
        ks = [s.params.top_k if 0 < s.params.top_k < vocab_size else 0 for s in rand_states]
        max_top_k = max(ks)
        if max_top_k > 0:
            top_k = i64(ks)
        if any(s.params.top_p < 1.0 for s in rand_states):
            top_p = f32([s.params.top_p for s in rand_states])
        if any(s.params.min_p > 0.0 for s in rand_states):
            min_p = f32([s.params.min_p for s in rand_states])

    repetition_penalty = seen_mask = None
    if any(s.params.repetition_penalty != 1.0 for s in states):
        repetition_penalty = f32([s.params.repetition_penalty for s in states])
        # Only rows that use the penalty contribute tokens: prompts can be long.
        seen = [
            [*s.prompt_token_ids, *s.output_token_ids] if s.params.repetition_penalty != 1.0 else []
            for s in states
        ]
        seen_mask = _token_mask(seen, vocab_size, device, counts=False)

    frequency_penalty = presence_penalty = output_counts = None
    if any(s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0 for s in states):
        frequency_penalty = f32([s.params.frequency_penalty for s in states])
        presence_penalty = f32([s.params.presence_penalty for s in states])
        outs = [
            s.output_token_ids
            if s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0
            else []
            for s in states
        ]
        output_counts = _token_mask(outs, vocab_size, device, counts=True)

    mt_rows: list[int] = []
    mt_ids: list[int] = []
    for i, s in enumerate(states):
        if len(s.output_token_ids) >= s.params.min_tokens:
            continue
        banned = set(s.params.stop_token_ids or [])
        if not s.params.ignore_eos:
            banned.update(s.eos_token_ids)
        banned = sorted(t for t in banned if 0 <= t < vocab_size)
        mt_rows.extend([i] * len(banned))
        mt_ids.extend(banned)
    min_tokens_rows = i64(mt_rows) if mt_rows else None
    min_tokens_ids = i64(mt_ids) if mt_ids else None

    wanted = [s.params.logprobs for s in states if s.params.logprobs is not None]
    max_num_logprobs = max(wanted) if wanted else None

    return SamplingBatch(
        num_reqs=num_reqs,
        vocab_size=vocab_size,
        device=device,
        all_greedy=all_greedy,
        all_random=all_random,
        random_rows=None if all_random or all_greedy else i64(random_idx),
        temperature=temperature,
        seeds=seeds,
        steps=steps,
        top_k=top_k,
        max_top_k=max_top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seen_mask=seen_mask,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        output_counts=output_counts,
        min_tokens_rows=min_tokens_rows,
        min_tokens_ids=min_tokens_ids,
        max_num_logprobs=max_num_logprobs,
    )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_reqs] int64
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

        if batch.max_num_logprobs is None:
            return SamplerOutput(sampled, None, None, None, None)
        lp, ranks, top_ids, top_lp = compute_logprobs(raw, sampled, batch.max_num_logprobs)
        return SamplerOutput(sampled, lp, ranks, top_ids, top_lp)

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
