"""What users get back: RequestOutput / CompletionOutput, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# One generated (or prompt) position: token id -> Logprob, the chosen token first.
PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    """Times are time.monotonic() seconds; durations derived from them are in seconds."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    def snapshot(self) -> RequestMetrics:
        """A copy (what dataclasses.replace(self) gives, at a third of its cost: one is
        taken per output of every step)."""
        copy = object.__new__(RequestMetrics)
        copy.__dict__.update(self.__dict__)
        return copy

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
    # Set when this request failed on its own (the batch went on): what went wrong. The
    # output is final and its sequences have finish_reason "error".
    error: str | None = None


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated token ids, as vLLM returns them
    cum_logprob: float
    text: str | None = None  # decode of `tokens`
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    score: float | None = None  # cum_logprob / generated_len ** length_penalty
    num_prompt_tokens: int = 0

    @property
    def generated_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first
