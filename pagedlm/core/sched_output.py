"""What crosses from the scheduler to the workers each step: plain, picklable data.

A worker keeps a persistent batch of the requests it knows (worker/input_batch.py). A
request is sent whole once, when the worker does not have it (`NewRequestData`: first
admission, resumption after preemption, a beam forked from another); after that, each
step carries only what changed (`CachedRequestData`): the tokens the worker has not seen
(the token sampled last step, or a beam's replaced last token), the block table entries
that changed (blocks appended; a copy-on-write block replacing a shared last block;
blocks a sliding window left behind turned into the null block), and progress. Requests
the worker must forget (finished, aborted, preempted) are listed once, and removed
before anything new is added.

    step k:   new_reqs=[A(prompt, params, blocks [3, 7])]   num_scheduled_tokens={A: 20}
    step k+1: cached_reqs: A  tokens from 20: [t20]  blocks from 2: []   computed 20
    step k+2: cached_reqs: A  tokens from 21: [t21]  blocks from 2: [9]  computed 21
    step k+3: finished_req_ids=[A]

No torch and no live `Request` here: the same message serves one in-process worker or
N tensor-parallel ranks in other processes or on other machines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedlm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the worker does not have yet, with everything it needs to run it."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated before (a resumed or forked request)
    sampling_params: SamplingParams
    seed: int
    eos_token_ids: tuple[int, ...]
    block_ids: list[int]  # the whole block table
    num_computed_tokens: int
    lora_slot: int = -1  # the LoRA slot of its adapter (core/lora_slots.py); -1: none


@dataclass
class CachedRequestData:
    """What changed for requests the worker already has, one column per field.

    Request `req_ids[i]`: tokens `new_token_ids[i]` go at positions `token_offsets[i]`
    onwards of its token ids (replacing what was there), block ids `new_block_ids[i]` at
    `block_offsets[i]` onwards of its block table, and its computed tokens are now
    `num_computed_tokens[i]`.
    """

    req_ids: list[str] = field(default_factory=list)
    token_offsets: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    block_offsets: list[int] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    def append(self, req_id: str, token_offset: int, new_token_ids: list[int],
               block_offset: int, new_block_ids: list[int], num_computed_tokens: int) -> None:
        self.req_ids.append(req_id)
        self.token_offsets.append(token_offset)
        self.new_token_ids.append(new_token_ids)
        self.block_offsets.append(block_offset)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(num_computed_tokens)

    def __len__(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step's work. The only thing a worker sees of the scheduler's decisions."""

    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    # Request id -> tokens to compute this step, in scheduling order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests to drop from the persistent batch before this step's are applied: those
    # finished, aborted or preempted since the last step, this step's preemptions included.
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # n > 1: samples that take their first token from a leader's logits at this step
    # (leader id -> followers). Each becomes a request of the batch, sharing the leader's
    # blocks; the scheduler lists it in `finished_req_ids` later if it does not start.
    fork_reqs: dict[str, list[NewRequestData]] = field(default_factory=dict)
    # Copy-on-write: copy block src to block dst in every layer before the forward pass.
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: request id -> the draft tokens it verifies at this step. Its
    # num_scheduled_tokens are 1 + len(drafts): its last token, then the drafts, whose
    # K/V are written after it; the model samples at each of those positions.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # LoRA: adapters to write into slots before this step runs (slot -> lora.adapter.
    # LoRAAdapter), sent once, when the scheduler first places them.
    lora_loads: dict[int, object] = field(default_factory=dict)
    # Prompt tokens computed by this step (for statistics; workers ignore it).
    num_prompt_tokens: int = 0
    # Structured outputs: the token bitmask of the constrained sequences that sample at
    # this step (a structured.PendingBitmask, filled while the forward runs).
    grammar_bitmask: object | None = None

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens
