"""Continuous batching under a token budget: pure policy, no tensors.

Every step the scheduler hands out at most `max_num_batched_tokens` tokens of work to at
most `max_num_seqs` requests. Running requests are served first, in admission order
(each decode costs one token; a request part-way through a chunked prefill takes what
the budget leaves), then waiting requests are admitted first come, first served, their
prompts chunked to fit the budget. When the cache has no block for a running request,
the most recently admitted running request is preempted: its blocks go back to the pool
and it returns to the front of the waiting queue, to be recomputed from its first token
(its generated tokens are kept, so nothing the user saw changes).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedlm.config import SchedulerConfig
from pagedlm.core.kv_cache_manager import KVCacheManager
from pagedlm.core.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` starting at `num_computed_tokens`."""

    request: Request
    num_computed_tokens: int  # position of the first token to compute
    num_new_tokens: int
    block_ids: list[int]  # the request's whole block table
    # The step computes the request's last known token, so a new one is sampled after it.
    sample: bool

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        start = self.num_computed_tokens
        return self.request.all_token_ids[start : start + self.num_new_tokens]


@dataclass
class SchedulerOutput:
    """The only thing the model runner sees of the scheduler's decisions."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ----- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.max_num_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} needs {request.num_prompt_tokens} prompt + "
                f"{request.max_tokens} max_tokens = {request.max_num_tokens} tokens, more than "
                f"max_model_len ({self.config.max_model_len})"
            )
        if not self.kv.can_ever_fit(request.max_num_tokens):
            raise ValueError(
                f"request {request.request_id!r} needs up to {request.max_num_tokens} tokens but "
                f"the whole KV cache holds {self.kv.capacity_tokens} "
                f"({self.kv.num_blocks} blocks of {self.kv.block_size}); lower max_tokens or give "
                f"the cache more memory"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests early (stop string matched, client gone). Unknown ids are ignored."""
        assert RequestStatus.is_finished(status)
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            finished.append(request)
        return finished

    def _free(self, request: Request) -> None:
        self.kv.free(request)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ----- one step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        # Running requests first, in admission order.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, request
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                self._add_to_output(out, request, num_new)
                budget -= num_new
                i += 1
                continue
            break  # the request preempted itself: nothing behind it is left to schedule

        # Then admit waiting requests, unless this step already had to preempt.
        while (
            not out.preempted_request_ids
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.kv.allocate_slots(request, num_new):
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            self._add_to_output(out, request, num_new)
            budget -= num_new
        return out

    def _add_to_output(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        reaches_end = request.num_computed_tokens + num_new == request.num_tokens
        out.scheduled.append(
            ScheduledRequest(
                request=request,
                num_computed_tokens=request.num_computed_tokens,
                num_new_tokens=num_new,
                block_ids=self.kv.get_block_ids(request.request_id),
                sample=reaches_end,
            )
        )
        out.num_scheduled_tokens += num_new

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ----- after the model ran ----------------------------------------------------------

    def update_from_output(
        self, out: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> list[Request]:
        """Advance progress, append sampled tokens, finish requests that hit a stop condition.

        Returns the requests whose state a user may want to see this step: every request
        that got a new token, finished or not.
        """
        updated = []
        for sched in out.scheduled:
            request = sched.request
            if request.is_finished():
                continue  # aborted while the step ran; its blocks are already back
            request.num_computed_tokens += sched.num_new_tokens
            if not sched.sample:
                continue
            token_id = sampled_token_ids[request.request_id]
            request.append_output_token(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                request.status = status
                self.running.remove(request)
                self._free(request)
            updated.append(request)
        return updated

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
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

    def check_invariants(self) -> None:
        live = list(self.running) + list(self.waiting)
        assert len({r.request_id for r in live}) == len(live)
        assert set(self.requests) == {r.request_id for r in live}
        assert len(self.running) <= self.config.max_num_seqs
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in self.waiting)
        for r in self.waiting:
            assert not self.kv.get_block_ids(r.request_id) or r.num_computed_tokens == 0
        self.kv.check_invariants(live)
