"""A request as the scheduler sees it: token ids, progress, status. No torch here."""

from __future__ import annotations

import enum
import time

from pagedlm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_LAST_UNFINISHED = RequestStatus.PREEMPTED

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence to generate.

    Progress is a single counter, `num_computed_tokens`: the number of leading tokens of
    `all_token_ids` whose K/V are in the cache. There are no prefill/decode phases: a
    request needs `num_tokens - num_computed_tokens` more tokens computed before the next
    one can be sampled, whether it is new, half-way through a chunked prefill, decoding
    (exactly one), or resuming after preemption (all of them again).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        seed: int,
        eos_token_ids: tuple[int, ...] = (),
        max_tokens: int | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora=None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.seed = seed
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        assert self.max_tokens is not None and self.max_tokens >= 1
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        # A stop token id or stop string that ended the request, as vLLM reports it.
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Prefix caching: chained hashes of the full blocks of all_token_ids, the number of
        # leading blocks already registered in the cache, and what else keys the content.
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0
        # An adapter (lora.adapter.LoRAAdapter) computes other K/V from the same tokens:
        # its content hash keys the blocks, so adapters never share them with each other
        # or with the base model.
        # Each part is tagged and the salt length-prefixed, so no salt can spell another
        # request's key.
        self.lora = lora
        self.cache_extra_key = b""
        if cache_salt:
            salt = cache_salt.encode()
            self.cache_extra_key += b"salt" + len(salt).to_bytes(4, "little") + salt
        if lora is not None:
            self.cache_extra_key += b"lora" + lora.content_hash
        # Prompt logprobs need logits at every prompt position, so nothing may be skipped.
        self.skip_prefix_cache = sampling_params.prompt_logprobs is not None
        self.num_cached_prompt_tokens = 0  # prompt tokens found in the cache at first admission
        # A paused request keeps its place and blocks but is not scheduled (a beam waiting
        # for its siblings before the next selection).
        self.paused = False
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        # When it was first scheduled and got its first token (time.monotonic(); None: not
        # yet). The dashboard's time in queue and TTFT.
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # Leading tokens of all_token_ids the workers hold (0: they do not hold the request).
        self.num_synced_tokens = 0
        # Speculative decoding: tokens proposed to follow all_token_ids, verified at the
        # next step that schedules this request as a decode (then cleared).
        self.spec_token_ids: list[int] = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """The most tokens this request can ever hold in the cache."""
        return self.num_prompt_tokens + self.max_tokens

    def is_finished(self) -> bool:
        return self.status > _LAST_UNFINISHED  # RequestStatus.is_finished, inlined

    def get_finish_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    def append_output_token(self, token_id: int) -> None:
        if not self.output_token_ids:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def replace_last_token(self, token_id: int) -> None:
        """Swap the last output token before it is computed (beam search picks the token
        itself after seeing the candidates)."""
        assert self.output_token_ids and self.num_computed_tokens < self.num_tokens
        self.output_token_ids[-1] = token_id
        self.all_token_ids[-1] = token_id
        if self.num_synced_tokens == self.num_tokens:
            self.num_synced_tokens -= 1  # the workers hold the old one: send it again

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})"
        )


def check_stop(request: Request, token_id: int) -> RequestStatus | None:
    """The finished status `request` takes now that it sampled `token_id` (its last
    output token), or None while it goes on. A stop token id is recorded as its
    `stop_reason`; stop strings are matched on text, by the engine's frontend."""
    params = request.sampling_params
    num_output = request.num_output_tokens
    if num_output >= params.min_tokens:
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
    if num_output >= request.max_tokens:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None

