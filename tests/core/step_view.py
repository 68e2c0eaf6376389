"""Scheduler tests see each step as the old per-request view, and every step also drives a
worker's persistent batch, checked against one built afresh from the scheduler's state.

    out = schedule(s)            s.schedule(), plus out.scheduled: [ScheduledView]
    out.scheduled[0].block_ids   the request's whole block table at scheduling time

A `SchedulerOutput` carries only what changed for requests the worker already holds; the
mirror batch applies it exactly as a worker does, so any delta the scheduler forgets
(a copy-on-write block, a replaced beam token, a preempted request sent again) shows up
as a difference with the fresh batch.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from pagedlm.core.request import Request
from pagedlm.core.sched_output import SchedulerOutput
from pagedlm.core.scheduler import Scheduler
from pagedlm.worker.input_batch import InputBatch

VOCAB = 1 << 20  # the made-up tokens of these tests stay below it


@dataclass
class ScheduledView:
    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int]
    sample: bool
    forks: list[Request] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        start = self.num_computed_tokens
        return self.request.all_token_ids[start : start + self.num_new_tokens]


_mirrors: weakref.WeakKeyDictionary[Scheduler, InputBatch] = weakref.WeakKeyDictionary()


def schedule(s: Scheduler) -> SchedulerOutput:
    """`s.schedule()`, with `out.scheduled` set, applied to the scheduler's mirror batch and
    checked against a fresh one."""
    out = s.schedule()
    attach_views(s, out)
    if out.is_empty:
        return out  # the engine never sends an empty step to its workers
    mirror = _mirrors.setdefault(s, InputBatch(VOCAB, max_num_rows=2, max_num_tokens=4,
                                               max_num_blocks=2))
    mirror.update(out)
    check_mirror(s, mirror, out)
    return out


def attach_views(s: Scheduler, out: SchedulerOutput) -> SchedulerOutput:
    """Set `out.scheduled` from the scheduler's state (call before update_from_output)."""
    computed = {n.req_id: n.num_computed_tokens for n in out.new_reqs}
    computed.update(zip(out.cached_reqs.req_ids, out.cached_reqs.num_computed_tokens))
    views = []
    for req_id, num_new in out.num_scheduled_tokens.items():
        request = s.requests[req_id]
        start = computed[req_id]
        forks = [s.requests[f.req_id] for f in out.fork_reqs.get(req_id, ())]
        views.append(ScheduledView(request, start, num_new, s.kv.get_block_ids(req_id),
                                   start + num_new == request.num_tokens, forks))
    out.scheduled = views
    return out


def check_mirror(s: Scheduler, batch: InputBatch, out: SchedulerOutput) -> None:
    """The persistent batch holds exactly the requests the workers were told of, each row
    equal to what a fresh row built now from the scheduler's request and block table holds."""
    held = {rid for rid, r in s.requests.items() if r.num_synced_tokens}
    # This step's forked samples share their leader's table; the scheduler forks the
    # blocks once they have sampled.
    leader_of = {f.req_id: leader for leader, fs in out.fork_reqs.items() for f in fs}
    assert set(batch.row_of) == held, (sorted(batch.row_of), sorted(held))
    for req_id in held:
        request = s.requests[req_id]
        row = batch.row_of[req_id]
        # The workers hold the tokens sent so far (a token sampled since is sent with the
        # request's next step) and the table up to its first entry changed since.
        n = request.num_synced_tokens
        assert batch.num_tokens[row] == n
        assert batch.token_ids[row, :n].tolist() == request.all_token_ids[:n]
        assert not batch.token_ids[row, n:].any()
        assert batch.num_prompt_tokens[row] == request.num_prompt_tokens
        blocks = s.kv.get_block_ids(leader_of.get(req_id, req_id))
        num_sent = s.kv._changed_from.get(req_id, len(blocks))
        if req_id in out.num_scheduled_tokens or req_id in leader_of:
            assert num_sent == len(blocks), req_id
            assert batch.num_blocks[row] == len(blocks), req_id
        assert batch.block_table[row, :num_sent].tolist() == blocks[:num_sent], req_id
        assert not batch.block_table[row, batch.num_blocks[row]:].any()
        if req_id in out.num_scheduled_tokens:
            view = next(v for v in out.scheduled if v.request_id == req_id)
            assert batch.num_computed_tokens[row] == view.num_computed_tokens
        assert batch.params[row] is request.sampling_params
        assert batch.seed[row] == request.seed % (1 << 63)
