"""A step's model inputs, gathered from the worker's persistent batch.

`prepare_inputs` turns a SchedulerOutput (already applied to the InputBatch) into the
tensors of one forward pass: token ids, positions, the attention metadata (block tables,
slot mapping), and which token rows are sampled. It is vectorised numpy over the
scheduled requests: no Python loop over tokens or blocks. Requests are ordered decodes
first (one query token each), then prefill chunks, which is the layout
`AttentionMetadata` describes.

A request verifying k speculative drafts becomes k + 1 one-token decode rows, and every
sample forked from a request (n > 1) shares its logits row; `StepInputs` records both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.core.sched_output import SchedulerOutput
from pagedlm.csrc import load_extension
from pagedlm.worker.input_batch import InputBatch


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] token index of each sampled row's last token
    # logits_indices is arange(num_tokens): every token row is sampled, in order (a decode
    # step), so the hidden states need no gather before the LM head.
    every_token_sampled: bool
    # The persistent-batch row and request id behind each sampled row: a request that
    # reached its last token, then each sample forked from it at this step (same logits
    # row, its own seed).
    sampled_rows: np.ndarray  # [num_sampled]
    sampled_req_ids: list[str]
    # Prompt-logprob rows: (request id, first position, token indices into the batch,
    # target prompt token ids)
    prompt_logprob_rows: list[tuple[str, int, np.ndarray, np.ndarray]]
    # Speculative decoding: per sampled row, the drafts before its position (0.. k for a
    # request verifying k drafts, which has k + 1 consecutive sampled rows); None: none.
    sampled_extra: np.ndarray | None = None
    # LoRA: [num_tokens] the adapter slot of each token (-1: none); None: no adapter.
    lora_slots: np.ndarray | None = None



def _decode_layout(batch: InputBatch, rows: np.ndarray, block_size: int) -> np.ndarray | None:
    """A decode-only step's layout from csrc/step_inputs_cpu.cpp, packed as it documents
    (a view of one of the batch's two layout buffers), or None without the kernel. The
    arrays go to the kernel as numpy arrays: no call into torch."""
    kernels = load_extension("step_inputs_cpu")
    if kernels is None or not len(rows):
        return None
    out = batch.layout_buffer(6 * len(rows) + 3 + len(rows) * batch.block_table.shape[1])
    used = kernels.decode_step_inputs(rows, batch.num_computed_tokens, batch.num_tokens,
                                      batch.token_ids, batch.num_blocks, batch.block_table,
                                      block_size, out)
    return out[:used]


def prepare_inputs(batch: InputBatch, sched: SchedulerOutput, block_size: int,
                   upload: Callable[[np.ndarray], torch.Tensor]) -> StepInputs:
    """The step's tensors, gathered from the persistent batch `batch` (after its
    `update(sched)`); `upload` moves a host array to the device."""
    row_of = batch.row_of
    spec = sched.spec_token_ids
    for req_id, drafts in spec.items():
        batch.write_drafts(req_id, drafts)
    req_ids = list(sched.num_scheduled_tokens)
    if batch.step_rows is not None and batch.step_rows[0] is sched:
        rows = batch.step_rows[1]  # found by `update` already
    else:
        rows = np.fromiter((row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
    # Decodes only, one token each (most steps)?
    decodes_only = not spec and sched.total_num_scheduled_tokens == len(req_ids)
    # Such a step's layout comes from the kernel in one call where it is built (its numpy
    # reference is the branch below).
    packed = _decode_layout(batch, rows, block_size) if decodes_only else None
    if packed is None:
        starts = batch.num_computed_tokens[rows]
    if not decodes_only:
        q_lens = np.fromiter(sched.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
    drafts_before = group = None
    if spec:
        # A request verifying k drafts becomes k + 1 one-token rows, decodes like any
        # other: its last token at position c, draft j at c + 1 + j, each row seeing
        # the cache up to itself. Every row's K/V is written before attention reads,
        # so this is causal attention over the drafts, through the decode kernels
        # (the C++ decoder, CUDA graphs) instead of the prefill path.
        k = np.fromiter((len(spec.get(r, ())) for r in req_ids), dtype=np.int64,
                        count=len(req_ids))
        reps = k + 1
        group = np.repeat(np.arange(len(req_ids)), reps)
        drafts_before = np.arange(len(group)) - np.repeat(np.cumsum(reps) - reps, reps)
        rows, starts = rows[group], starts[group] + drafts_before
        q_lens = np.where(k[group] > 0, 1, q_lens[group])
    # Decodes first, longest context first (the attention backend buckets decodes by
    # length), then prefill chunks, each group in scheduling order (a stable sort).
    num_reqs = len(rows)
    every_row = False  # every row samples, in order (most steps)
    if packed is not None:
        n = num_reqs
        rows, positions, seq_lens, input_ids, slot_mapping = (packed[i * n:(i + 1) * n] for i in range(5))
        cu = packed[5 * n:6 * n + 1]
        every_row, max_blocks = bool(packed[6 * n + 1]), int(packed[6 * n + 2])
        block_tables = packed[6 * n + 3:].reshape(n, max_blocks)
        max_query_len, max_seq_len = 1, int(seq_lens[0])
        num_decodes = num_tokens = num_reqs
        starts = positions
        req_of_token = cu[:-1]
    elif decodes_only:  # the same layout in fewer passes
        order = np.argsort(-starts, kind="stable")
        rows, starts = rows[order], starts[order]
        max_query_len = 1
        num_decodes = num_tokens = num_reqs
        seq_lens = starts + 1
        max_seq_len = int(seq_lens[0])  # longest first
        cu = np.arange(num_reqs + 1, dtype=np.int64)
        req_of_token = cu[:-1]
        positions = starts
        row_of_token = rows
    else:
        is_prefill = q_lens != 1
        order = np.lexsort((np.where(is_prefill, 0, -starts), is_prefill))
        rows, q_lens, starts = rows[order], q_lens[order], starts[order]
        num_decodes = num_reqs - int(is_prefill.sum())
        seq_lens = starts + q_lens
        max_query_len, max_seq_len = int(q_lens.max()), int(seq_lens.max())
        cu = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        num_tokens = int(cu[-1])
        req_of_token = np.repeat(np.arange(num_reqs), q_lens)  # [num_tokens]
        positions = np.arange(num_tokens, dtype=np.int64) - cu[req_of_token] + starts[req_of_token]
        row_of_token = rows[req_of_token]
    if packed is None:
        input_ids = batch.token_ids[row_of_token, positions]  # [num_tokens]
        max_blocks = int(batch.num_blocks[rows].max())
        block_tables = batch.block_table[rows, :max_blocks]  # [num_reqs, max_blocks]
        block_index, block_offset = np.divmod(positions, block_size)
        slot_mapping = block_tables[req_of_token, block_index] * block_size + block_offset

    # A request samples when the step reaches its last token (each of the rows of a
    # request verifying drafts samples: as if the drafts before it were generated).
    last_index = req_of_token if decodes_only else cu[1:] - 1
    sampled_extra = None
    if spec:
        drafts_before, group = drafts_before[order], group[order]
        samples = np.flatnonzero(seq_lens == batch.num_tokens[rows] + drafts_before)
        # A verifying request's rows consecutive, in draft order (ModelRunner._verify).
        samples = samples[np.lexsort((drafts_before[samples], group[samples]))]
        sampled_extra = drafts_before[samples]
    elif every_row:
        samples = last_index
    else:
        reaches_end = seq_lens == batch.num_tokens[rows]
        every_row = decodes_only and bool(reaches_end.all())
        samples = last_index if every_row else np.flatnonzero(reaches_end)
    if not sched.fork_reqs:
        sampled_rows = rows if every_row else rows[samples]
        logits_indices = last_index if every_row else last_index[samples]
    else:
        sampled_list: list[int] = []
        index_list: list[int] = []
        extra_list: list[int] = []
        for i in samples.tolist():
            row = int(rows[i])
            # Forks only follow a prompt's last chunk, never a verifying request.
            followers = () if spec and drafts_before[i] else sched.fork_reqs.get(
                batch.req_ids[row], ())
            for r in (row, *(row_of[f.req_id] for f in followers)):
                sampled_list.append(r)
                index_list.append(int(last_index[i]))
                extra_list.append(int(drafts_before[i]) if spec else 0)
        sampled_rows = np.array(sampled_list, dtype=np.int64)
        logits_indices = np.array(index_list, dtype=np.int64)
        if spec:
            sampled_extra = np.array(extra_list, dtype=np.int64)
    sampled_req_ids = [batch.req_ids[r] for r in sampled_rows.tolist()]

    prompt_rows = []
    wanted = np.flatnonzero(batch.num_prompt_logprobs[rows] >= 0).tolist() if batch.uses("prompt_logprobs") else ()
    for i in wanted:
        row = int(rows[i])
        # Position p predicts prompt token p + 1; only positions inside the prompt count.
        first = int(starts[i])
        last = min(first + int(cu[i + 1] - cu[i]), int(batch.num_prompt_tokens[row]) - 1)
        if last <= first:
            continue
        idx = np.arange(cu[i], cu[i] + (last - first), dtype=np.int64)
        targets = batch.token_ids[row, first + 1 : last + 1].copy()
        prompt_rows.append((batch.req_ids[row], first + 1, idx, targets))

    lora_slots = None
    if batch.num_lora_rows:
        lora_slots = batch.lora_slot[rows][req_of_token]  # [num_tokens]

    up = upload
    meta = AttentionMetadata(
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        num_prefills=num_reqs - num_decodes,
        num_tokens=num_tokens,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        query_start_loc=up(cu),
        seq_lens=up(seq_lens),
        block_tables=up(block_tables),
        slot_mapping=up(slot_mapping),
        query_start_loc_cpu=cu.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
    )
    return StepInputs(
        input_ids=up(input_ids),
        positions=up(positions),
        meta=meta,
        logits_indices=up(logits_indices),
        every_token_sampled=not spec and not sched.fork_reqs and len(samples) == num_tokens,
        sampled_rows=sampled_rows,
        sampled_req_ids=sampled_req_ids,
        prompt_logprob_rows=prompt_rows,
        sampled_extra=sampled_extra,
        lora_slots=lora_slots,
    )
