"""Continuous batching under a token budget: pure policy, no tensors.

Every step the scheduler hands out at most `max_num_batched_tokens` tokens of work to at
most `max_num_seqs` requests. Running requests are served first, in admission order
(each decode costs one token; a request part-way through a chunked prefill takes what
the budget leaves), then waiting requests are admitted first come, first served, their
prompts chunked to fit the budget. While any request is decoding, the prompt work of a
step is bounded further (`max_prefill_tokens_with_decodes`), so no decode waits behind a
whole long prompt: inter-token latency stays steady under load. When the cache has no block for a running request,
the most recently admitted running request is preempted: its blocks go back to the pool
and it returns to the front of the waiting queue, to be recomputed from its first token
(its generated tokens are kept, so nothing the user saw changes).

This file is the policy; what it decides with lives apart: what a scheduled request
sends the workers (core/output_builder.py), samples waiting for their leader
(core/pending_forks.py), LoRA slots (core/lora_slots.py), KV blocks
(core/kv_cache_manager.py) and when a request stops (`check_stop`, core/request.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence

from pagedlm.config import SchedulerConfig
from pagedlm.core.kv_cache_manager import KVCacheManager
from pagedlm.core.lora_slots import LoRASlots
from pagedlm.core.output_builder import OutputBuilder
from pagedlm.core.pending_forks import PendingForks
from pagedlm.core.request import Request, RequestStatus, check_stop
from pagedlm.core.sched_output import SchedulerOutput


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 lora_slots: LoRASlots | None = None) -> None:
        self.config = config
        self.kv = kv_cache_manager
        # LoRA: which adapter each worker slot holds (None: LoRA is off).
        self.lora_slots = lora_slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Samples waiting for their leader's prompt: leader id -> requests to fork from it.
        self.pending_forks = PendingForks()
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # tokens found
        # update_from_output: request id -> tokens it got beyond one (accepted drafts).
        self.num_extra_tokens: dict[str, int] = {}
        self._output = OutputBuilder(kv_cache_manager, lora_slots, self.pending_forks)

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
        # A step computes at most max_num_batched_tokens of it (which bounds what a
        # sliding-window request holds at once).
        if not self.kv.can_ever_fit(request.max_num_tokens, self.config.max_num_batched_tokens):
            raise ValueError(
                f"request {request.request_id!r} needs up to {request.max_num_tokens} tokens but "
                f"the whole KV cache holds {self.kv.capacity_tokens} "
                f"({self.kv.num_blocks} blocks of {self.kv.block_size}); lower max_tokens or give "
                f"the cache more memory"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def add_forked_requests(self, leader: Request, followers: list[Request]) -> None:
        """Samples 2..n of a request: they start when `leader` samples its first token,
        sharing the leader's prompt blocks instead of computing the prompt again."""
        assert leader.request_id in self.requests and not leader.output_token_ids
        for follower in followers:
            if follower.request_id in self.requests:
                raise ValueError(f"request_id {follower.request_id!r} is already in use")
            follower.status = RequestStatus.WAITING
            self.requests[follower.request_id] = follower
        self.pending_forks.add(leader.request_id, followers)

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
            elif request in self.waiting:
                self.waiting.remove(request)
            else:
                self.pending_forks.remove(request)
            request.status = status
            self._free(request)
            finished.append(request)
        return finished

    def _free(self, request: Request) -> None:
        self._output.unsync(request)
        self.kv.free(request)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.pending_forks)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_pending_forks(self) -> int:
        """Samples 2..n of requests whose first sample has not sampled yet."""
        return self.pending_forks.num_followers

    # ----- one step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        prefill_budget = self._prefill_budget()

        # Running requests first, in admission order.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.paused:
                i += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, request
            drafts = request.spec_token_ids
            if drafts:
                request.spec_token_ids = []
            if num_new > 1:  # a prompt chunk (or a recomputation): bounded next to decodes
                num_new = min(num_new, prefill_budget)
                if num_new == 0:
                    i += 1
                    continue
                prefill_budget -= num_new
            elif drafts:  # a decode verifying drafts: its last token, then the drafts
                num_verified = self._schedule_drafts(out, request, drafts, budget)
                if num_verified:
                    budget -= num_verified
                    i += 1
                    continue
                # No room for them: decode plainly (preempting for it if need be).
            if (not self.kv.allocate_slots(request, num_new)
                    and not self._preempt_for(out, request, num_new)):
                break  # the request preempted itself: nothing behind it is left to schedule
            self.kv.cache_blocks(request, request.num_computed_tokens + num_new)
            self._output.add(out, request, num_new)
            budget -= num_new
            i += 1

        # Then admit waiting requests, unless this step already had to preempt. One whose
        # adapter finds no LoRA slot is passed over (`skipped`), for this step.
        skipped: set[int] = set()
        while (
            not out.preempted_request_ids
            and budget > 0
            and prefill_budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = next((r for r in self.waiting if not r.paused and id(r) not in skipped),
                           None)
            if request is None:
                break
            assert request.num_computed_tokens == 0
            if request.lora is not None and not self.lora_slots.admit(request.lora,
                                                                      self._adapters_in_use):
                skipped.add(id(request))
                continue
            hits = self.kv.get_computed_blocks(request)
            num_hit_tokens = len(hits) * self.kv.block_size
            num_new = request.num_tokens - num_hit_tokens
            limit = min(budget, prefill_budget)
            if num_new > limit:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = limit
            if not self.kv.allocate_slots(request, num_new, hits):
                break
            self._admit(out, request, num_hit_tokens, num_new)
            budget -= num_new
            prefill_budget -= num_new
        self._output.finish(out)
        return out

    def _admit(self, out: SchedulerOutput, request: Request, num_hit_tokens: int,
               num_new: int) -> None:
        """Move a waiting request whose slots are allocated to the running ones: it
        computes `num_new` tokens after the `num_hit_tokens` the prefix cache holds."""
        self.waiting.remove(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        request.num_computed_tokens = num_hit_tokens
        if request.num_preemptions == 0:
            request.num_cached_prompt_tokens = num_hit_tokens
        if self.kv.enable_caching and not request.skip_prefix_cache:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
        self.kv.cache_blocks(request, num_hit_tokens + num_new)
        self._output.add(out, request, num_new)

    def _adapters_in_use(self) -> Iterable[bytes]:
        """The content hashes of running requests' adapters (which no LoRA slot may drop)."""
        return (r.lora.content_hash for r in self.running if r.lora)

    def _schedule_drafts(self, out: SchedulerOutput, request: Request, drafts: list[int],
                         budget: int) -> int:
        """Schedule a decode that verifies speculative `drafts`: its last token, then the
        drafts worth verifying, within the step's token budget, the context and what the
        request may still generate (a step emits at most drafts + 1 tokens). Returns the
        tokens scheduled; 0 (nothing done) if no draft fits or their blocks do not."""
        drafts = drafts[:max(0, min(budget - 1,
                                    self.config.max_model_len - request.num_tokens,
                                    request.max_tokens - request.num_output_tokens - 1))]
        if not drafts or not self.kv.allocate_slots(request, 1 + len(drafts)):
            return 0
        self.kv.cache_blocks(request, request.num_tokens)  # drafts are not hashed
        self._output.add(out, request, 1 + len(drafts))
        out.spec_token_ids[request.request_id] = drafts
        return 1 + len(drafts)

    def _preempt_for(self, out: SchedulerOutput, request: Request, num_new: int) -> bool:
        """Preempt the most recently admitted running requests until `request` gets the
        slots for `num_new` tokens. False if it had to preempt `request` itself."""
        while True:
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_request_ids.append(victim.request_id)
            if victim is request:
                return False
            if self.kv.allocate_slots(request, num_new):
                return True

    def _prefill_budget(self) -> int:
        """The prompt tokens (chunks, recomputation) this step may compute. While any
        request decodes, at most `max_prefill_tokens_with_decodes`: a long prompt is then
        spread over several steps instead of stalling every stream for one long step.
        Without chunked prefill a prompt cannot be split, so it is not bounded."""
        cap = self.config.max_prefill_tokens_with_decodes
        if cap is None or not self.config.enable_chunked_prefill:
            return self.config.max_num_batched_tokens
        for request in self.running:
            if not request.paused and request.num_tokens - request.num_computed_tokens == 1:
                return cap
        return self.config.max_num_batched_tokens

    def _preempt(self, request: Request) -> None:
        request.spec_token_ids = []
        self._output.unsync(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ----- after the model ran ----------------------------------------------------------

    def update_from_output(
        self, out: SchedulerOutput, sampled_token_ids: dict[str, int],
        extra_token_ids: dict[str, list[int]] | None = None,
    ) -> list[Request]:
        """Advance progress, append sampled tokens, finish requests that hit a stop condition.
        `extra_token_ids`: for requests that verified drafts, the accepted drafts after the
        first token (the tokens they also got this step).

        Returns the requests whose state a user may want to see this step: every request
        that got a new token, finished or not. `num_extra_tokens` then says, per request
        id, how many tokens beyond one it got.
        """
        extra_token_ids = extra_token_ids or {}
        updated = []
        self.num_extra_tokens = {}
        spec = out.spec_token_ids
        for request_id, num_new in out.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue  # aborted while the step ran; its blocks are already back
            if request_id in spec:
                updated.append(self._accept(request, num_new, len(spec[request_id]),
                                            sampled_token_ids[request_id],
                                            extra_token_ids.get(request_id, ())))
                continue
            request.num_computed_tokens += num_new
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prompt chunk: nothing sampled yet
            if request_id in out.fork_reqs:
                for follower in self._start_forks(request):
                    updated.append(self._append_token(follower, sampled_token_ids[follower.request_id]))
            updated.append(self._append_token(request, sampled_token_ids[request_id]))
        return updated

    def _accept(self, request: Request, num_new: int, num_drafts: int, token_id: int,
                accepted: Sequence[int]) -> Request:
        """A verified decode: the K/V of its last token and of the accepted drafts are now
        in the cache; it gets the first sampled token and then one per accepted draft
        (up to a stop), and gives back the blocks only rejected drafts used."""
        request.num_computed_tokens += num_new - (num_drafts - len(accepted))
        self._append_token(request, token_id)
        appended = 0
        for extra in accepted:
            if request.is_finished():
                break
            self._append_token(request, extra)
            appended += 1
        if appended:
            self.num_extra_tokens[request.request_id] = appended
        if not request.is_finished():
            self.kv.free_excess_blocks(request)
        return request

    def _start_forks(self, leader: Request) -> list[Request]:
        """Fork the leader's pending samples that fit under max_num_seqs; the others become
        ordinary waiting requests (they will find the prompt's full blocks in the prefix
        cache, and compute the rest themselves)."""
        followers = self.pending_forks.pop(leader.request_id, [])
        room = self.config.max_num_seqs - len(self.running)
        started, deferred = followers[: max(0, room)], followers[max(0, room) :]
        for follower in started:
            self.kv.fork(leader, follower)
            follower.num_computed_tokens = leader.num_computed_tokens
            follower.status = RequestStatus.RUNNING
            follower.first_scheduled_time = leader.first_scheduled_time
            self.running.append(follower)
        for follower in reversed(deferred):
            self._output.unsync(follower)
            self.waiting.appendleft(follower)
        return started

    def fork_request(self, parent: Request, child: Request) -> None:
        """Start `child` (a copy of `parent`'s tokens, perhaps with a different last,
        uncomputed token) sharing the parent's computed blocks. Without room under
        max_num_seqs, or if the parent holds no blocks, the child waits and recomputes."""
        if child.request_id in self.requests:
            raise ValueError(f"request_id {child.request_id!r} is already in use")
        self.requests[child.request_id] = child
        if parent.status == RequestStatus.RUNNING and len(self.running) < self.config.max_num_seqs:
            self.kv.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        else:
            child.num_computed_tokens = 0
            child.status = RequestStatus.WAITING
            self.waiting.appendleft(child)

    def _append_token(self, request: Request, token_id: int) -> Request:
        request.append_output_token(token_id)
        status = check_stop(request, token_id)
        if status is not None:
            request.status = status
            self.running.remove(request)
            self._free(request)
        return request

    def check_invariants(self) -> None:
        live = list(self.running) + list(self.waiting) + self.pending_forks.followers()
        assert len({r.request_id for r in live}) == len(live)
        assert set(self.requests) == {r.request_id for r in live}
        assert len(self.running) <= self.config.max_num_seqs
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in self.waiting)
        for r in self.waiting:
            assert not self.kv.get_block_ids(r.request_id) or r.num_computed_tokens == 0
        self.kv.check_invariants(live)
        if self.lora_slots is not None:
            self.lora_slots.check_invariants()
            for r in self.running:  # a running request's adapter is in a slot
                assert r.lora is None or r.lora.content_hash in self.lora_slots.slot_of
