"""What crosses the engine core's boundary: requests in, a step's outputs out, the facts
the frontend needs. Plain picklable data (token ids, no text, no torch tensors), so the
core can run in a process of its own (engine/core_process.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedlm.outputs import BeamSearchOutput
from pagedlm.sampling_params import BeamSearchParams, SamplingParams
from pagedlm.worker.model_runner import TokenLogprobs


def sequence_ids(request_id: str, num_seqs: int) -> list[str]:
    """The scheduler's ids for the samples of a user request."""
    return [request_id] if num_seqs == 1 else [f"{i}_{request_id}" for i in range(num_seqs)]


@dataclass
class CoreRequest:
    """A validated user request, as token ids. `params` are the sequences' own parameters
    (with best_of, logprobs are on so the frontend can rank the samples)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seeds: list[int]  # one per sequence, in sequence_ids() order
    max_tokens: int
    arrival_time: float
    cache_salt: str | None = None
    lora_name: str | None = None  # an adapter added to the core (EngineCore.add_lora)


@dataclass
class CoreBeamRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: BeamSearchParams
    lora_name: str | None = None


@dataclass
class SeqOutput:
    """One sequence's new token of this step."""

    seq_id: str
    token_id: int
    logprobs: TokenLogprobs | None = None
    finish_reason: str | None = None  # "stop" (a stop token), "length"
    stop_reason: int | None = None  # the stop token id, if it was one of stop_token_ids
    num_preemptions: int = 0
    # "stop" because its structured-output grammar is complete: the last token is text
    # (not a stop token to hide).
    grammar_done: bool = False


@dataclass
class CoreOutputs:
    """What one step of the core produced, for every request at once."""

    outputs: list[SeqOutput] = field(default_factory=list)
    # Sequences that reached the workers for the first time (queueing ends there).
    scheduled_seq_ids: list[str] = field(default_factory=list)
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = field(default_factory=dict)
    beam_results: list[tuple[str, BeamSearchOutput]] = field(default_factory=list)
    # User requests that failed on their own this step (all their sequences are ended and
    # their blocks freed) -> what went wrong.
    failed: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.outputs or self.scheduled_seq_ids or self.prompt_logprobs
                    or self.beam_results or self.failed)


@dataclass(frozen=True)
class CoreInfo:
    """Facts about the loaded engine the frontend needs, constant after start-up."""

    max_model_len: int
    vocab_size: int
    device: str
    num_blocks: int
    block_size: int
    lora_enabled: bool = False
