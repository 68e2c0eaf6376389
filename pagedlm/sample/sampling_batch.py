"""The sampler's input for one step: `SamplingBatch`, the tensors of every stage a row of
the batch uses, and `make_sampling_batch`, which builds it from per-request states.

`make_sampling_batch` is the reference: the worker's persistent batch
(worker/input_batch.py) gathers the same tensors from its numpy columns, and is tested
against it. The pieces both need (the seed range, the ids min_tokens masks, the scatter
that turns token ids into a vocab-wide mask) live here, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedlm.sampling_params import SamplingParams

# Seeds are reduced to [0, 2**63) so they fit an int64 tensor.
SEED_MODULUS = 1 << 63


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

    Optional tensors are None when no row needs them (their default: a builder sets
    only the stages the step's rows use), and the Sampler then skips that stage
    entirely. Per-random-row tensors are indexed by position among the random rows
    (`random_rows` maps them back to batch rows).
    """

    num_reqs: int
    vocab_size: int
    device: torch.device
    all_greedy: bool
    all_random: bool
    # Batch rows that sample randomly; None when all rows do (or none do).
    random_rows: torch.Tensor | None = None  # [num_random] int64
    # Random rows only:
    temperature: torch.Tensor | None = None  # [num_random] float32
    seeds: torch.Tensor | None = None  # [num_random] int64, in [0, 2**63)
    steps: torch.Tensor | None = None  # [num_random] int64, len(output_token_ids)
    top_k: torch.Tensor | None = None  # [num_random] int64, 0 = disabled
    max_top_k: int = 0  # largest enabled top_k among random rows (0 if none)
    top_p: torch.Tensor | None = None  # [num_random] float32
    min_p: torch.Tensor | None = None  # [num_random] float32
    # All rows:
    repetition_penalty: torch.Tensor | None = None  # [num_reqs] float32
    seen_mask: torch.Tensor | None = None  # [num_reqs, vocab] bool, prompt+output tokens
    frequency_penalty: torch.Tensor | None = None  # [num_reqs] float32
    presence_penalty: torch.Tensor | None = None  # [num_reqs] float32
    output_counts: torch.Tensor | None = None  # [num_reqs, vocab] int32
    # min_tokens: logits[min_tokens_rows[i], min_tokens_ids[i]] = -inf.
    min_tokens_rows: torch.Tensor | None = None  # [num_masked] int64
    min_tokens_ids: torch.Tensor | None = None  # [num_masked] int64
    # Largest `logprobs` in the batch; None if no row asked for logprobs.
    max_num_logprobs: int | None = None


def min_tokens_banned_ids(params: SamplingParams, eos_token_ids: Sequence[int],
                          vocab_size: int) -> list[int]:
    """The ids a row may not sample before it has `min_tokens` output tokens: its stop
    token ids and (unless `ignore_eos`) the EOS ids, sorted; ids outside the vocabulary
    are left out (they can never be sampled, so there is nothing to mask)."""
    banned = set(params.stop_token_ids or [])
    if not params.ignore_eos:
        banned.update(eos_token_ids)
    return sorted(t for t in banned if 0 <= t < vocab_size)


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

    batch = SamplingBatch(num_reqs, vocab_size, device, all_greedy, all_random)
    if not (all_random or all_greedy):
        batch.random_rows = i64(random_idx)
    if rand_states:
        batch.temperature = f32([s.params.temperature for s in rand_states])
        batch.seeds = i64([s.seed % SEED_MODULUS for s in rand_states])
        batch.steps = i64([len(s.output_token_ids) for s in rand_states])
        ks = [s.params.top_k if 0 < s.params.top_k < vocab_size else 0 for s in rand_states]
        batch.max_top_k = max(ks)
        if batch.max_top_k > 0:
            batch.top_k = i64(ks)
        if any(s.params.top_p < 1.0 for s in rand_states):
            batch.top_p = f32([s.params.top_p for s in rand_states])
        if any(s.params.min_p > 0.0 for s in rand_states):
            batch.min_p = f32([s.params.min_p for s in rand_states])

    if any(s.params.repetition_penalty != 1.0 for s in states):
        batch.repetition_penalty = f32([s.params.repetition_penalty for s in states])
        # Only rows that use the penalty contribute tokens: prompts can be long.
        seen = [
            [*s.prompt_token_ids, *s.output_token_ids] if s.params.repetition_penalty != 1.0 else []
            for s in states
        ]
        batch.seen_mask = _token_mask(seen, vocab_size, device, counts=False)

    if any(s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0 for s in states):
        batch.frequency_penalty = f32([s.params.frequency_penalty for s in states])
        batch.presence_penalty = f32([s.params.presence_penalty for s in states])
        outs = [
            s.output_token_ids
            if s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0
            else []
            for s in states
        ]
        batch.output_counts = _token_mask(outs, vocab_size, device, counts=True)

    mt_rows: list[int] = []
    mt_ids: list[int] = []
    for i, s in enumerate(states):
        if len(s.output_token_ids) >= s.params.min_tokens:
            continue
        banned = min_tokens_banned_ids(s.params, s.eos_token_ids, vocab_size)
        mt_rows.extend([i] * len(banned))
        mt_ids.extend(banned)
    if mt_rows:
        batch.min_tokens_rows = i64(mt_rows)
        batch.min_tokens_ids = i64(mt_ids)

    wanted = [s.params.logprobs for s in states if s.params.logprobs is not None]
    batch.max_num_logprobs = max(wanted) if wanted else None
    return batch
