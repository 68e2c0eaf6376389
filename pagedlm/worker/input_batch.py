"""The worker's persistent batch: every request it holds, one row each, kept from step to
step and changed only by what a `SchedulerOutput` says changed.

    row        token_ids (prompt | output)      block_table       sampling columns
    0  "a"     [ 5 9 2 7 | 11 4 . . . ]         [ 3 7 . . ]       t=0.8 k=0  seed ...
    1  free
    2  "b"     [ 8 1 | . . . . . . . ]          [ 2 . . . ]       t=0   k=40 seed ...

Rows are numpy arrays, so a step's inputs (token ids, positions, block tables, slot
mapping) and its sampling tensors are gathered for all scheduled rows at once, never
rebuilt from Python lists. Entries of a row past its tokens / blocks are zero. Arrays
grow (doubling) when more rows, tokens or blocks are needed.

Invariant: for every request the worker holds, its row equals what a freshly built row
would be from the scheduler's `Request` and block table (tests/test_input_batch.py).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedlm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedlm.csrc import load_extension
from pagedlm.sample.sampling_batch import (
    SEED_MODULUS,
    SamplingBatch,
    min_tokens_banned_ids,
    scatter_token_mask,
)
from pagedlm.sampling_params import SamplingParams

_STAGES = ("greedy", "top_k", "top_p", "min_p", "repetition", "penalties", "min_tokens",
           "logprobs", "prompt_logprobs")


def _stages_of(p: SamplingParams, vocab_size: int) -> list[str]:
    """The optional sampling stages a request's parameters use (and whether it wants
    prompt logprobs)."""
    used = [name for name, on in (
        ("greedy", p.is_greedy),
        ("top_k", 0 < p.top_k < vocab_size),
        ("top_p", p.top_p < 1.0),
        ("min_p", p.min_p > 0.0),
        ("repetition", p.repetition_penalty != 1.0),
        ("penalties", p.frequency_penalty != 0.0 or p.presence_penalty != 0.0),
        ("min_tokens", p.min_tokens > 0),
        ("logprobs", p.logprobs is not None),
        ("prompt_logprobs", p.prompt_logprobs is not None),
    ) if on]
    return used


def _grow(a: np.ndarray, rows: int, cols: int | None = None) -> np.ndarray:
    shape = (rows,) if a.ndim == 1 else (rows, cols)
    out = np.zeros(shape, dtype=a.dtype)
    if a.ndim == 1:
        out[: a.shape[0]] = a
    else:
        out[: a.shape[0], : a.shape[1]] = a
    return out


def _widen(a: np.ndarray, num_cols: int) -> np.ndarray:
    """`a` itself if it has `num_cols` columns, else a copy with twice as many (or more)."""
    width = a.shape[1]
    if num_cols <= width:
        return a
    while width < num_cols:
        width *= 2
    return _grow(a, a.shape[0], width)


class InputBatch:
    def __init__(self, vocab_size: int, max_num_rows: int = 64, max_num_tokens: int = 256,
                 max_num_blocks: int = 16) -> None:
        self.vocab_size = vocab_size
        self.req_ids: list[str | None] = [None] * max_num_rows  # row -> request id
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_rows - 1, -1, -1))  # lowest row first
        self.params: list[SamplingParams | None] = [None] * max_num_rows
        self.eos_token_ids: list[tuple[int, ...]] = [()] * max_num_rows
        self.token_ids = np.zeros((max_num_rows, max_num_tokens), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_rows, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_rows, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_rows, dtype=np.int64)
        self.block_table = np.zeros((max_num_rows, max_num_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_rows, dtype=np.int64)
        # Sampling columns, set once per request (SamplingParams is immutable in flight).
        self.greedy = np.zeros(max_num_rows, dtype=bool)
        self.temperature = np.zeros(max_num_rows, dtype=np.float32)
        self.seed = np.zeros(max_num_rows, dtype=np.int64)
        self.top_k = np.zeros(max_num_rows, dtype=np.int64)  # 0 = off
        self.top_p = np.zeros(max_num_rows, dtype=np.float32)
        self.min_p = np.zeros(max_num_rows, dtype=np.float32)
        self.repetition_penalty = np.zeros(max_num_rows, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_rows, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_rows, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_rows, dtype=np.int64)
        self.num_logprobs = np.zeros(max_num_rows, dtype=np.int64)  # -1 = none
        self.num_prompt_logprobs = np.zeros(max_num_rows, dtype=np.int64)  # -1 = none
        self.lora_slot = np.zeros(max_num_rows, dtype=np.int64)  # -1 = none
        self.num_lora_rows = 0
        # Rows that use each optional sampling stage: a stage no row uses is skipped without
        # looking at the step's rows at all (most batches use none of them).
        self._uses = dict.fromkeys(_STAGES, 0)
        # (the SchedulerOutput last applied, the rows of its requests in its order) when
        # `update` found them all cached, for prepare_inputs; else None.
        self.step_rows: tuple[SchedulerOutput, np.ndarray] | None = None
        self._layout_buffers = [np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)]
        self._layout_turn = 0

    @property
    def num_reqs(self) -> int:
        return len(self.row_of)

    def layout_buffer(self, size: int) -> np.ndarray:
        """An int64 array of at least `size` elements for the packed layout of a decode
        step (step_inputs.py), kept from step to step. Two take turns, so the tensors of
        the step before, which view the other one, stay intact while this one is filled."""
        self._layout_turn ^= 1
        buf = self._layout_buffers[self._layout_turn]
        if buf.shape[0] < size:
            buf = self._layout_buffers[self._layout_turn] = np.empty(2 * size, dtype=np.int64)
        return buf

    def uses(self, stage: str) -> bool:
        """Whether any row uses an optional stage of `_STAGES`."""
        return self._uses[stage] > 0

    # ----- applying a step's changes ---------------------------------------------------------

    def update(self, sched: SchedulerOutput) -> None:
        """Forget finished requests, add new ones (and this step's forked samples), then
        apply the deltas of the others."""
        for req_id in sched.finished_req_ids:
            self.remove(req_id)
        for new in sched.new_reqs:
            self.add(new)
        for followers in sched.fork_reqs.values():
            for new in followers:
                self.add(new)
        cached = sched.cached_reqs
        self.step_rows = None
        if not len(cached):
            return
        row_of = self.row_of
        rows = np.fromiter((row_of[r] for r in cached.req_ids), dtype=np.int64,
                           count=len(cached))
        if not sched.new_reqs:  # then these are the step's requests, in its order
            self.step_rows = (sched, rows)
        # The common delta, one token (a decode's last sample, or a beam's replaced last
        # token), is written for all requests at once; longer ones (a resumed fork) and
        # block-table changes (one request in block_size per step) one request at a time.
        new_token_ids, token_offsets = cached.new_token_ids, cached.token_offsets
        kernels = load_extension("step_inputs_cpu")
        if kernels is not None:  # in one call (csrc/step_inputs_cpu.cpp; numpy below)
            self._fit_tokens(max(token_offsets) + 1)
            longer = kernels.apply_token_deltas(
                rows, cached.num_computed_tokens, new_token_ids, token_offsets,
                self.num_computed_tokens, self.num_tokens, self.token_ids)
        else:
            longer = self._apply_one_token_deltas(rows, cached)
        for i in longer:
            row, tokens = int(rows[i]), new_token_ids[i]
            start = token_offsets[i]
            end = start + len(tokens)
            self._fit_tokens(end)
            self.token_ids[row, start:end] = tokens
            self.token_ids[row, end : self.num_tokens[row]] = 0
            self.num_tokens[row] = end
        if not any(cached.new_block_ids):
            return
        num_blocks = self.num_blocks
        for i, blocks in enumerate(cached.new_block_ids):
            if not blocks:  # tables never shrink: an unchanged one sends nothing
                continue
            start = cached.block_offsets[i]
            row = int(rows[i])
            end = start + len(blocks)
            self._fit_blocks(end)
            self.block_table[row, start:end] = blocks
            self.block_table[row, end : num_blocks[row]] = 0
            num_blocks[row] = end

    def _apply_one_token_deltas(self, rows: np.ndarray, cached: CachedRequestData) -> list[int]:
        """`update`'s computed-token counts and one-token deltas with numpy: the reference
        of csrc/step_inputs_cpu.cpp's apply_token_deltas. Returns the requests whose delta
        is longer."""
        self.num_computed_tokens[rows] = cached.num_computed_tokens
        new_token_ids, token_offsets = cached.new_token_ids, cached.token_offsets
        lens = list(map(len, new_token_ids))
        if lens.count(1) == len(lens):  # every request one token (most steps)
            one_rows, one_offsets = rows, token_offsets
            one_tokens = [tokens[0] for tokens in new_token_ids]
            longer: list[int] = []
        else:
            ones = [i for i, n in enumerate(lens) if n == 1]
            one_rows, one_offsets = rows[ones], [token_offsets[i] for i in ones]
            one_tokens = [new_token_ids[i][0] for i in ones]
            longer = [i for i, n in enumerate(lens) if n > 1]
        if one_offsets:
            offsets = np.asarray(one_offsets, dtype=np.int64)
            self._fit_tokens(max(one_offsets) + 1)
            self.token_ids[one_rows, offsets] = one_tokens
            # Appending grows the row by one; replacing its last token (the one other
            # one-token delta) leaves its length: either way it ends after the token.
            self.num_tokens[one_rows] = offsets + 1
        return longer

    def add(self, new: NewRequestData) -> None:
        assert new.req_id not in self.row_of, new.req_id
        if not self._free_rows:
            self._grow_rows(2 * len(self.req_ids))
        row = self._free_rows.pop()
        self.req_ids[row] = new.req_id
        self.row_of[new.req_id] = row
        num_prompt = len(new.prompt_token_ids)
        num_tokens = num_prompt + len(new.output_token_ids)
        self._fit_tokens(num_tokens)
        self.token_ids[row, :num_prompt] = new.prompt_token_ids
        self.token_ids[row, num_prompt:num_tokens] = new.output_token_ids
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = num_prompt
        self.num_computed_tokens[row] = new.num_computed_tokens
        self._fit_blocks(len(new.block_ids))
        self.block_table[row, : len(new.block_ids)] = new.block_ids
        self.num_blocks[row] = len(new.block_ids)

        p = new.sampling_params
        self.params[row] = p
        for stage in _stages_of(p, self.vocab_size):
            self._uses[stage] += 1
        self.eos_token_ids[row] = tuple(new.eos_token_ids)
        self.greedy[row] = p.is_greedy
        self.temperature[row] = p.temperature
        self.seed[row] = new.seed % SEED_MODULUS
        self.top_k[row] = p.top_k if 0 < p.top_k < self.vocab_size else 0
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.repetition_penalty[row] = p.repetition_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.presence_penalty[row] = p.presence_penalty
        self.min_tokens[row] = p.min_tokens
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.num_prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.lora_slot[row] = new.lora_slot
        self.num_lora_rows += new.lora_slot >= 0

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id)
        for stage in _stages_of(self.params[row], self.vocab_size):
            self._uses[stage] -= 1
        self.req_ids[row] = None
        self.params[row] = None
        self.num_lora_rows -= self.lora_slot[row] >= 0
        self.lora_slot[row] = -1
        self.token_ids[row, : self.num_tokens[row]] = 0
        self.block_table[row, : self.num_blocks[row]] = 0
        self.num_tokens[row] = self.num_blocks[row] = 0
        self._free_rows.append(row)

    def _grow_rows(self, num_rows: int) -> None:
        old = len(self.req_ids)
        for name, value in vars(self).items():
            if isinstance(value, np.ndarray):
                setattr(self, name, _grow(value, num_rows, value.shape[1] if value.ndim == 2 else None))
        self.req_ids.extend([None] * (num_rows - old))
        self.params.extend([None] * (num_rows - old))
        self.eos_token_ids.extend([()] * (num_rows - old))
        self._free_rows = list(range(num_rows - 1, old - 1, -1)) + self._free_rows

    def write_drafts(self, req_id: str, drafts: list[int]) -> None:
        """Speculative decoding: a request's draft tokens, after its tokens (its length
        does not change: the next step's delta overwrites them with what was accepted)."""
        row = self.row_of[req_id]
        start = int(self.num_tokens[row])
        self._fit_tokens(start + len(drafts))
        self.token_ids[row, start:start + len(drafts)] = drafts

    def _fit_tokens(self, num_tokens: int) -> None:
        self.token_ids = _widen(self.token_ids, num_tokens)

    def _fit_blocks(self, num_blocks: int) -> None:
        self.block_table = _widen(self.block_table, num_blocks)

    # ----- what a step reads -----------------------------------------------------------------

    def sampling_batch(self, rows: np.ndarray, device: torch.device,
                       extra: np.ndarray | None = None) -> SamplingBatch:
        """The sampling tensors for batch rows `rows` (row indices of this batch, in the
        order of the logits rows), as `sampling_batch.make_sampling_batch` builds them from
        per-request states; that function is the reference this one is tested against.

        `extra` (speculative decoding): per logits row, how many draft tokens (written
        after the row's tokens in `token_ids`) count as already generated, so that the
        row samples exactly as it would once they had been: its noise step, penalties
        and min_tokens see them."""
        num_reqs = len(rows)
        uses = self._uses
        # The rows that sample at random (all of them when no row is greedy).
        random_idx = np.flatnonzero(~self.greedy[rows]) if uses["greedy"] else None
        num_random = num_reqs if random_idx is None else random_idx.size
        all_greedy = num_random == 0
        all_random = not all_greedy and num_random == num_reqs
        num_tokens = self.num_tokens[rows] if extra is None else self.num_tokens[rows] + extra
        num_output = num_tokens - self.num_prompt_tokens[rows]
        if not isinstance(device, torch.device):
            device = torch.device(device)
        on_host = device.type == "cpu"

        def up(a: np.ndarray) -> torch.Tensor:  # `a` is always a fresh, contiguous array
            t = torch.from_numpy(a)
            return t if on_host else t.to(device)

        batch = SamplingBatch(num_reqs, self.vocab_size, device, all_greedy, all_random)
        if not (all_random or all_greedy):
            batch.random_rows = up(random_idx.astype(np.int64))
        if not all_greedy:
            rand = rows if all_random else rows[random_idx]
            batch.temperature = up(self.temperature[rand])
            batch.seeds = up(self.seed[rand])
            batch.steps = up(num_output if all_random else num_output[random_idx])
            if uses["top_k"]:
                ks = self.top_k[rand]
                batch.max_top_k = int(ks.max())
                if batch.max_top_k > 0:
                    batch.top_k = up(ks)
            if uses["top_p"]:
                ps = self.top_p[rand]
                if (ps < 1.0).any():
                    batch.top_p = up(ps)
            if uses["min_p"]:
                mps = self.min_p[rand]
                if (mps > 0.0).any():
                    batch.min_p = up(mps)

        rep = self.repetition_penalty[rows] if uses["repetition"] else None
        if rep is not None and (rep != 1.0).any():
            batch.repetition_penalty = up(rep)
            positions = np.arange(self.token_ids.shape[1])
            valid = (positions[None, :] < num_tokens[:, None]) & (rep != 1.0)[:, None]
            batch.seen_mask = self._token_mask(rows, valid, num_tokens, device, counts=False)

        if uses["penalties"]:
            freq, pres = self.frequency_penalty[rows], self.presence_penalty[rows]
            penalised = (freq != 0.0) | (pres != 0.0)
        if uses["penalties"] and penalised.any():
            batch.frequency_penalty, batch.presence_penalty = up(freq), up(pres)
            positions = np.arange(self.token_ids.shape[1])
            valid = ((positions[None, :] >= self.num_prompt_tokens[rows][:, None])
                     & (positions[None, :] < num_tokens[:, None]) & penalised[:, None])
            batch.output_counts = self._token_mask(rows, valid, num_tokens, device, counts=True)

        short = np.flatnonzero(num_output < self.min_tokens[rows]) if uses["min_tokens"] else ()
        if len(short):  # rare: a Python loop over those rows only
            mt_rows: list[int] = []
            mt_ids: list[int] = []
            for i in short.tolist():
                row = int(rows[i])
                banned = min_tokens_banned_ids(self.params[row], self.eos_token_ids[row],
                                               self.vocab_size)
                mt_rows.extend([i] * len(banned))
                mt_ids.extend(banned)
            if mt_rows:
                batch.min_tokens_rows = torch.tensor(mt_rows, dtype=torch.int64, device=device)
                batch.min_tokens_ids = torch.tensor(mt_ids, dtype=torch.int64, device=device)

        if uses["logprobs"] and num_reqs:
            lps = self.num_logprobs[rows]
            batch.max_num_logprobs = int(lps.max()) if lps.max() >= 0 else None
        return batch

    def _token_mask(self, rows: np.ndarray, valid: np.ndarray, num_tokens: np.ndarray,
                    device: torch.device, counts: bool) -> torch.Tensor:
        """[len(rows), vocab] counts (int32) or presence (bool) of the tokens of each row
        where `valid`."""
        width = int(num_tokens.max(initial=0))
        ids = np.where(valid[:, :width], self.token_ids[rows, :width], self.vocab_size)
        return scatter_token_mask(torch.from_numpy(np.ascontiguousarray(ids)).to(device),
                                  self.vocab_size, counts)
