"""Scheduler driven by a fake model loop (no torch).

Each step: `schedule()`, then `update_from_output(out, {rid: token})` with a made-up
token for every scheduled request whose `sample` flag is set.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedlm.config import SchedulerConfig
from pagedlm.core.kv_cache_manager import KVCacheManager, cdiv
from pagedlm.core.request import Request, RequestStatus
from pagedlm.core.scheduler import Scheduler, SchedulerOutput
from pagedlm.sampling_params import SamplingParams
from tests.core.step_view import schedule

EOS = 2


def make_scheduler(
    num_blocks: int,
    block_size: int = 4,
    budget: int = 16,
    max_seqs: int = 8,
    max_model_len: int | None = None,
    chunked: bool = True,
    prefill_cap: int | None = None,
) -> Scheduler:
    if max_model_len is None:
        max_model_len = num_blocks * block_size
    config = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        max_prefill_tokens_with_decodes=prefill_cap,
    )
    return Scheduler(config, KVCacheManager(num_blocks=num_blocks, block_size=block_size))


def make_request(
    rid: str, prompt_len: int, max_tokens: int, eos: tuple[int, ...] = (EOS,), **params
) -> Request:
    params.setdefault("ignore_eos", True)
    return Request(
        rid,
        [100 + i for i in range(prompt_len)],
        SamplingParams(max_tokens=max_tokens, **params),
        seed=0,
        eos_token_ids=eos,
    )


def token_for(request: Request) -> int:
    """A made-up token that identifies the request and the output position."""
    return 1000 * (int(request.request_id.lstrip("r")) + 1) + request.num_output_tokens


def step(
    s: Scheduler, tokens: Callable[[Request], int] | dict[str, int] = token_for
) -> tuple[SchedulerOutput, list[Request]]:
    out = schedule(s)
    s.check_invariants()
    sampled = {}
    for sr in out.scheduled:
        if sr.sample:
            rid = sr.request_id
            sampled[rid] = tokens[rid] if isinstance(tokens, dict) else tokens(sr.request)
    updated = s.update_from_output(out, sampled)
    s.check_invariants()
    return out, updated


def summary(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [
        (r.request_id, r.num_computed_tokens, r.num_new_tokens, r.sample) for r in out.scheduled
    ]


def run_to_completion(s: Scheduler, max_steps: int = 500) -> int:
    steps = 0
    while s.has_unfinished_requests():
        out, _ = step(s)
        assert not out.is_empty, "no progress"
        steps += 1
        assert steps <= max_steps
    return steps


# ----- budget, max_num_seqs, ordering ----------------------------------------------------


def test_empty_scheduler() -> None:
    s = make_scheduler(4)
    out = schedule(s)
    assert out.is_empty and out.total_num_scheduled_tokens == 0 and out.preempted_request_ids == []
    assert not s.has_unfinished_requests()
    assert s.num_running == 0 and s.num_waiting == 0


def test_token_budget_chunks_and_decode_first() -> None:
    s = make_scheduler(16, budget=8)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 10, 3))
    assert s.num_waiting == 3
    out, _ = step(s)
    assert summary(out) == [("r0", 0, 8, False)]
    out, _ = step(s)
    assert summary(out) == [("r0", 8, 2, True), ("r1", 0, 6, False)]
    out, _ = step(s)
    # r0 now decodes one token, ahead of everything else.
    assert summary(out) == [("r0", 10, 1, True), ("r1", 6, 4, True), ("r2", 0, 3, False)]
    out, _ = step(s)
    assert summary(out) == [("r0", 11, 1, True), ("r1", 10, 1, True), ("r2", 3, 6, False)]
    assert out.total_num_scheduled_tokens == 8
    steps = run_to_completion(s)
    assert steps < 20


def test_prompt_work_is_bounded_while_requests_decode() -> None:
    s = make_scheduler(32, budget=16, prefill_cap=3)
    s.add_request(make_request("r0", 4, 4))
    out, _ = step(s)
    assert summary(out) == [("r0", 0, 4, True)]  # nothing decodes yet: the whole budget
    s.add_request(make_request("r1", 10, 2))
    s.add_request(make_request("r2", 2, 2))
    out, _ = step(s)
    # r0 decodes, so prompts get 3 tokens: r1's first chunk, and r2 must wait.
    assert summary(out) == [("r0", 4, 1, True), ("r1", 0, 3, False)]
    out, _ = step(s)
    assert summary(out) == [("r0", 5, 1, True), ("r1", 3, 3, False)]
    out, _ = step(s)
    assert summary(out) == [("r0", 6, 1, True), ("r1", 6, 3, False)]
    out, _ = step(s)
    # r0 finished last step (4 tokens): no decode left, so the rest of the budget is free.
    assert summary(out) == [("r1", 9, 1, True), ("r2", 0, 2, True)]
    out, _ = step(s)
    assert summary(out) == [("r1", 10, 1, True), ("r2", 2, 1, True)]
    assert not s.has_unfinished_requests()


def test_prompt_bound_does_not_apply_without_chunked_prefill() -> None:
    s = make_scheduler(32, budget=64, max_model_len=64, chunked=False, prefill_cap=2)
    s.add_request(make_request("r0", 3, 3))
    step(s)
    s.add_request(make_request("r1", 8, 2))
    out, _ = step(s)
    assert summary(out) == [("r0", 3, 1, True), ("r1", 0, 8, True)]


def test_budget_never_exceeded_and_counts_match() -> None:
    s = make_scheduler(32, budget=5)
    for i in range(6):
        s.add_request(make_request(f"r{i}", 3 + i, 4))
    while s.has_unfinished_requests():
        out, _ = step(s)
        assert 0 < out.total_num_scheduled_tokens <= 5
        assert out.total_num_scheduled_tokens == sum(r.num_new_tokens for r in out.scheduled)


def test_max_num_seqs() -> None:
    s = make_scheduler(16, budget=64, max_seqs=2)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 2, 2))
    out, _ = step(s)
    assert [r.request_id for r in out.scheduled] == ["r0", "r1"]
    assert s.num_running == 2 and s.num_waiting == 1
    out, _ = step(s)  # r0 and r1 finish
    assert [r.request_id for r in out.scheduled] == ["r0", "r1"]
    assert s.num_running == 0
    out, _ = step(s)
    assert summary(out) == [("r2", 0, 2, True)]


def test_decodes_come_before_new_admissions() -> None:
    s = make_scheduler(16, budget=16)
    s.add_request(make_request("r0", 4, 5))
    step(s)
    s.add_request(make_request("r1", 6, 5))
    s.add_request(make_request("r2", 3, 5))
    out, _ = step(s)
    assert summary(out) == [("r0", 4, 1, True), ("r1", 0, 6, True), ("r2", 0, 3, True)]
    # Running order is admission order.
    assert [r.request_id for r in s.running] == ["r0", "r1", "r2"]


def test_budget_exhausted_by_running_leaves_waiting() -> None:
    s = make_scheduler(16, budget=2)
    s.add_request(make_request("r0", 1, 4))
    s.add_request(make_request("r1", 1, 4))
    step(s)  # r0 and r1 prefill one token each
    s.add_request(make_request("r2", 1, 4))
    out, _ = step(s)
    assert summary(out) == [("r0", 1, 1, True), ("r1", 1, 1, True)]
    assert [r.request_id for r in s.waiting] == ["r2"]


# ----- chunked prefill ------------------------------------------------------------------


def test_long_prompt_split_into_budget_chunks() -> None:
    s = make_scheduler(16, budget=8)
    r = make_request("r0", 21, 2)
    s.add_request(r)
    chunks = []
    while r.num_output_tokens == 0:
        out, updated = step(s)
        (sr,) = out.scheduled
        chunks.append((sr.num_computed_tokens, sr.num_new_tokens, sr.sample, len(sr.block_ids)))
        assert sr.token_ids == r.prompt_token_ids[sr.num_computed_tokens :][: sr.num_new_tokens]
        assert updated == ([r] if sr.sample else [])
    assert chunks == [(0, 8, False, 2), (8, 8, False, 4), (16, 5, True, 6)]
    assert r.num_computed_tokens == 21 and r.output_token_ids == [token_for_first(r)]


def token_for_first(r: Request) -> int:
    return 1000 * (int(r.request_id.lstrip("r")) + 1)


def test_chunked_prefill_disabled_waits_for_budget() -> None:
    s = make_scheduler(8, budget=16, max_model_len=16, chunked=False)
    s.add_request(make_request("r0", 10, 3))
    s.add_request(make_request("r1", 10, 3))
    out, _ = step(s)
    assert summary(out) == [("r0", 0, 10, True)]
    out, _ = step(s)
    assert summary(out) == [("r0", 10, 1, True), ("r1", 0, 10, True)]
    run_to_completion(s)


def test_admitted_in_the_step_after_another_finishes() -> None:
    # 4 blocks of 4: r0 (10 prompt + 2) holds 3 blocks, r1 (8 prompt) needs 2.
    s = make_scheduler(4, budget=16)
    r0, r1 = make_request("r0", 10, 2), make_request("r1", 8, 1)
    s.add_request(r0)
    s.add_request(r1)
    out, _ = step(s)
    assert summary(out) == [("r0", 0, 10, True)]
    assert s.kv.num_free_blocks == 1 and list(s.waiting) == [r1]
    out, updated = step(s)
    assert summary(out) == [("r0", 10, 1, True)]
    assert updated == [r0] and r0.status == RequestStatus.FINISHED_LENGTH_CAPPED
    # r0's blocks came back at once (tail first), so r1 fits in the very next step.
    assert s.kv.num_free_blocks == 4
    assert s.kv.block_pool.free_queue.block_ids() == [3, 2, 1, 0]
    out, _ = step(s)
    assert summary(out) == [("r1", 0, 8, True)]
    assert out.scheduled[0].block_ids == [3, 2]
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == 4


def test_waiting_is_fifo_head_of_line() -> None:
    # r1 does not fit; r2 would, but waits behind it (first come, first served).
    s = make_scheduler(4, budget=32)
    s.add_request(make_request("r0", 8, 4))
    step(s)
    s.add_request(make_request("r1", 12, 1))  # needs 3 blocks
    s.add_request(make_request("r2", 2, 1))  # needs 1 block
    out, _ = step(s)  # r0 takes a third block for its decode: 1 block left
    assert summary(out) == [("r0", 8, 1, True)]
    assert [r.request_id for r in s.waiting] == ["r1", "r2"]
    assert s.kv.num_free_blocks == 1


# ----- preemption -----------------------------------------------------------------------


def test_preemption_exact_trace() -> None:
    # 5 blocks of 4 tokens, budget 4.
    s = make_scheduler(5, budget=4)
    a, b, c = make_request("r0", 4, 8), make_request("r1", 4, 8), make_request("r2", 2, 10)
    for r in (a, b, c):
        s.add_request(r)

    def trace(out: SchedulerOutput):
        return [(r.request_id, r.num_new_tokens, r.block_ids) for r in out.scheduled]

    out, _ = step(s)
    assert trace(out) == [("r0", 4, [0])]
    out, _ = step(s)
    assert trace(out) == [("r0", 1, [0, 1]), ("r1", 3, [2])]
    out, _ = step(s)
    assert trace(out) == [("r0", 1, [0, 1]), ("r1", 1, [2]), ("r2", 2, [3])]
    out, _ = step(s)
    assert trace(out) == [("r0", 1, [0, 1]), ("r1", 1, [2, 4]), ("r2", 1, [3])]
    out, _ = step(s)
    assert trace(out) == [("r0", 1, [0, 1]), ("r1", 1, [2, 4]), ("r2", 1, [3])]
    assert s.kv.num_free_blocks == 0
    c_outputs = list(c.output_token_ids)
    assert len(c_outputs) == 3

    # r0 needs a fifth token slot: the most recently admitted (r2) is preempted.
    out, _ = step(s)
    assert out.preempted_request_ids == ["r2"]
    assert trace(out) == [("r0", 1, [0, 1, 3]), ("r1", 1, [2, 4])]
    assert c.status == RequestStatus.PREEMPTED
    assert list(s.waiting) == [c]
    assert c.num_computed_tokens == 0 and s.kv.get_block_ids("r2") == []
    assert c.output_token_ids == c_outputs
    assert c.num_preemptions == 1 and s.num_preemptions == 1

    out, _ = step(s)
    assert trace(out) == [("r0", 1, [0, 1, 3]), ("r1", 1, [2, 4])]
    assert out.preempted_request_ids == []

    # r1 needs a block and is itself the most recent: it preempts itself. Its two
    # blocks are free and budget is left, yet nothing waiting is admitted this step.
    out, _ = step(s)
    assert out.preempted_request_ids == ["r1"]
    assert trace(out) == [("r0", 1, [0, 1, 3])]
    assert [r.request_id for r in s.waiting] == ["r1", "r2"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.num_preemptions == 2 and b.num_preemptions == 1
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED  # 8 tokens by now

    # r1 comes back first, recomputing prompt + its 5 outputs, in budget-sized chunks,
    # into the blocks freed last (r1's tail first, then r0's tail first).
    assert s.kv.block_pool.free_queue.block_ids() == [4, 2, 3, 1, 0]
    out, _ = step(s)
    assert trace(out) == [("r1", 4, [4])]
    assert out.scheduled[0].token_ids == b.prompt_token_ids
    out, _ = step(s)
    assert trace(out) == [("r1", 4, [4, 2])]
    assert out.scheduled[0].token_ids == b.output_token_ids[:4]
    out, _ = step(s)
    assert summary(out) == [("r1", 8, 1, True), ("r2", 0, 3, False)]
    assert [r.block_ids for r in out.scheduled] == [[4, 2, 3], [1]]

    run_to_completion(s)
    for r in (a, b, c):
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert r.num_output_tokens == r.max_tokens
        assert r.output_token_ids == [token_for_first(r) + i for i in range(r.max_tokens)]
    assert c.output_token_ids[:3] == c_outputs
    assert s.kv.num_free_blocks == 5
    assert s.requests == {}


def test_preempt_other_then_self() -> None:
    # 4 blocks of 2. r0 fills 2 blocks; r1, r2 one each. r0 then needs one more and
    # r2 (admitted last) is preempted; next step r1 needs one and preempts itself.
    s = make_scheduler(4, block_size=2, budget=16)
    s.add_request(make_request("r0", 4, 4))
    s.add_request(make_request("r1", 1, 3))
    s.add_request(make_request("r2", 1, 3))
    out, _ = step(s)
    assert [r.block_ids for r in out.scheduled] == [[0, 1], [2], [3]]
    out, _ = step(s)
    assert out.preempted_request_ids == ["r2"]
    assert summary(out) == [("r0", 4, 1, True), ("r1", 1, 1, True)]
    assert [r.block_ids for r in out.scheduled] == [[0, 1, 3], [2]]
    out, _ = step(s)
    # r1 (tokens 2 -> needs a second block) preempts itself: r0 keeps running.
    assert out.preempted_request_ids == ["r1"]
    assert [r.request_id for r in s.waiting] == ["r1", "r2"]
    run_to_completion(s)
    assert s.num_preemptions >= 2
    assert s.kv.num_free_blocks == 4


def test_last_running_request_preempts_itself() -> None:
    # Both need a second block; the later one gives way, the earlier one keeps going.
    s = make_scheduler(3, block_size=2, budget=16)
    s.add_request(make_request("r0", 2, 3))
    s.add_request(make_request("r1", 2, 3))
    out, _ = step(s)
    assert [r.block_ids for r in out.scheduled] == [[0], [1]]
    out, _ = step(s)  # r0 and r1 both need a second block, only one free
    assert out.preempted_request_ids == ["r1"]
    assert summary(out) == [("r0", 2, 1, True)]
    run_to_completion(s)


# ----- add_request validation -----------------------------------------------------------


def test_reject_request_longer_than_cache() -> None:
    s = make_scheduler(4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"17 tokens.*16"):
        s.add_request(make_request("r0", 10, 7))
    assert not s.has_unfinished_requests() and s.requests == {}
    # Exactly the cache is fine and completes on its own.
    s.add_request(make_request("r1", 10, 6))
    run_to_completion(s)
    assert s.kv.num_free_blocks == 4


def test_reject_request_over_max_model_len() -> None:
    s = make_scheduler(16, block_size=4, max_model_len=12)
    with pytest.raises(ValueError, match=r"13 tokens.*max_model_len \(12\)"):
        s.add_request(make_request("r0", 10, 3))
    s.add_request(make_request("r1", 10, 2))
    assert s.num_waiting == 1


def test_reject_duplicate_request_id() -> None:
    s = make_scheduler(8)
    s.add_request(make_request("r0", 2, 2))
    with pytest.raises(ValueError, match="r0"):
        s.add_request(make_request("r0", 3, 2))
    assert s.num_waiting == 1
    step(s)  # running now
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("r0", 3, 2))
    run_to_completion(s)
    # A finished id may be reused.
    s.add_request(make_request("r0", 3, 2))
    run_to_completion(s)


# ----- stop conditions ------------------------------------------------------------------


def test_eos_stops() -> None:
    s = make_scheduler(8)
    r = make_request("r0", 3, 10, ignore_eos=False)
    s.add_request(r)
    step(s, {"r0": 7})
    _, updated = step(s, {"r0": EOS})
    assert updated == [r]
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.get_finish_reason() == "stop" and r.stop_reason is None
    assert r.output_token_ids == [7, EOS]
    assert not s.has_unfinished_requests() and s.kv.num_free_blocks == 8


def test_ignore_eos_runs_to_max_tokens() -> None:
    s = make_scheduler(8)
    r = make_request("r0", 3, 4, ignore_eos=True)
    s.add_request(r)
    for _ in range(4):
        step(s, {"r0": EOS})
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.get_finish_reason() == "length"
    assert r.output_token_ids == [EOS] * 4


def test_stop_token_ids_set_stop_reason() -> None:
    s = make_scheduler(8)
    r = make_request("r0", 3, 10, stop_token_ids=[5, 9])
    s.add_request(r)
    step(s, {"r0": 4})
    assert r.status == RequestStatus.RUNNING
    step(s, {"r0": 9})
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 9
    assert r.output_token_ids == [4, 9]


def test_max_tokens_length_capped() -> None:
    s = make_scheduler(8)
    r = make_request("r0", 3, 3, ignore_eos=False)
    s.add_request(r)
    for i in range(3):
        assert r.status != RequestStatus.FINISHED_LENGTH_CAPPED
        step(s, {"r0": 50 + i})
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.output_token_ids == [50, 51, 52] and r.stop_reason is None


def test_eos_on_last_allowed_token_is_stop_not_length() -> None:
    s = make_scheduler(8)
    r = make_request("r0", 3, 2, ignore_eos=False)
    s.add_request(r)
    step(s, {"r0": 7})
    step(s, {"r0": EOS})
    assert r.status == RequestStatus.FINISHED_STOPPED


def test_min_tokens_delays_eos_and_stop_tokens() -> None:
    s = make_scheduler(8)
    r = make_request("r0", 3, 10, ignore_eos=False, min_tokens=3, stop_token_ids=[6])
    s.add_request(r)
    step(s, {"r0": EOS})
    step(s, {"r0": 6})
    assert r.status == RequestStatus.RUNNING and r.stop_reason is None
    step(s, {"r0": EOS})  # third output token: min_tokens reached
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == [EOS, 6, EOS]


def test_request_level_max_tokens_override() -> None:
    s = make_scheduler(8)
    r = Request(
        "r0", [1, 2], SamplingParams(max_tokens=None, ignore_eos=True), seed=0, max_tokens=3
    )
    s.add_request(r)
    run_to_completion(s)
    assert r.num_output_tokens == 3 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_only_sampled_requests_are_updated() -> None:
    s = make_scheduler(16, budget=6)
    r0, r1 = make_request("r0", 2, 3), make_request("r1", 10, 3)
    s.add_request(r0)
    s.add_request(r1)
    out, updated = step(s)
    assert summary(out) == [("r0", 0, 2, True), ("r1", 0, 4, False)]
    assert updated == [r0]
    assert r1.num_output_tokens == 0 and r1.num_computed_tokens == 4


# ----- abort ----------------------------------------------------------------------------


def test_finish_requests_waiting_running_and_unknown() -> None:
    s = make_scheduler(8, budget=16, max_seqs=2)
    reqs = [make_request(f"r{i}", 5, 4) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    step(s)
    assert [r.request_id for r in s.running] == ["r0", "r1"]
    assert s.kv.num_free_blocks == 4
    # Abort a running request: its blocks are free at once.
    finished = s.finish_requests(["r1", "nope"], RequestStatus.FINISHED_ABORTED)
    assert finished == [reqs[1]]
    assert reqs[1].status == RequestStatus.FINISHED_ABORTED
    assert reqs[1].get_finish_reason() == "abort"
    assert s.kv.num_free_blocks == 6 and s.kv.get_block_ids("r1") == []
    s.check_invariants()
    # Abort a waiting request (never scheduled) and an already finished one.
    assert s.finish_requests(["r2", "r1"], RequestStatus.FINISHED_ABORTED) == [reqs[2]]
    assert s.num_waiting == 0
    s.check_invariants()
    # Abort the last running request.
    s.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == 8 and s.requests == {}
    assert schedule(s).is_empty


def test_finish_requests_preempted_request() -> None:
    s = make_scheduler(3, block_size=2, budget=16)
    s.add_request(make_request("r0", 2, 3))
    s.add_request(make_request("r1", 2, 3))
    step(s)
    out, _ = step(s)
    assert out.preempted_request_ids == ["r1"]
    assert s.requests["r1"].status == RequestStatus.PREEMPTED
    (r1,) = s.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
    assert r1.status == RequestStatus.FINISHED_ABORTED
    s.check_invariants()
    run_to_completion(s)
    assert s.kv.num_free_blocks == 3


def test_finish_requests_with_stopped_status() -> None:
    s = make_scheduler(8)
    s.add_request(make_request("r0", 2, 5))
    step(s)
    (r,) = s.finish_requests(["r0"], RequestStatus.FINISHED_STOPPED)
    assert r.status == RequestStatus.FINISHED_STOPPED
    with pytest.raises(AssertionError):
        s.finish_requests(["r0"], RequestStatus.RUNNING)


def test_abort_frees_blocks_for_waiting_request() -> None:
    s = make_scheduler(4, budget=32)
    s.add_request(make_request("r0", 12, 4))
    s.add_request(make_request("r1", 8, 2))
    out, _ = step(s)
    assert summary(out) == [("r0", 0, 12, True)]
    s.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
    out, _ = step(s)
    assert summary(out) == [("r1", 0, 8, True)]
    assert out.scheduled[0].block_ids == [3, 2]


# ----- property-based workloads ---------------------------------------------------------


@st.composite
def workloads(draw):
    block_size = draw(st.integers(1, 4))
    num_blocks = draw(st.integers(1, 10))
    capacity = block_size * num_blocks
    chunked = draw(st.booleans())
    budget = draw(st.integers(1, 16))
    if not chunked:
        budget = max(budget, capacity)
    max_seqs = draw(st.integers(1, 8))
    prefill_cap = draw(st.one_of(st.none(), st.integers(1, 8)))
    n = draw(st.integers(1, 8))
    reqs = []
    for _ in range(n):
        # Now and then more than the cache holds: rejected by add_request.
        total = draw(st.integers(2, max(2, capacity + (1 if draw(st.booleans()) else 0))))
        # Short prompts with long outputs are what runs the cache dry mid-decode.
        short = draw(st.booleans())
        prompt = draw(st.integers(1, max(1, min(total - 1, 3) if short else total - 1)))
        max_tokens = max(1, total - prompt)
        arrival = draw(st.integers(0, 4))
        abort_at = draw(st.integers(0, 30)) if draw(st.integers(0, 4)) == 0 else None
        reqs.append((prompt, max_tokens, arrival, abort_at))
    return block_size, num_blocks, chunked, budget, max_seqs, prefill_cap, reqs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_complete(workload) -> None:
    block_size, num_blocks, chunked, budget, max_seqs, prefill_cap, specs = workload
    capacity = block_size * num_blocks
    s = make_scheduler(
        num_blocks,
        block_size=block_size,
        budget=budget,
        max_seqs=max_seqs,
        max_model_len=capacity,
        chunked=chunked,
        prefill_cap=prefill_cap,
    )
    reqs = [make_request(f"r{i}", p, m) for i, (p, m, _, _) in enumerate(specs)]
    added: set[str] = set()
    aborted: set[str] = set()
    steps = 0
    while True:
        for r, (p, m, arrival, _) in zip(reqs, specs):
            if arrival == steps:
                if p + m > capacity:
                    with pytest.raises(ValueError):
                        s.add_request(r)
                    aborted.add(r.request_id)
                else:
                    s.add_request(r)
                    added.add(r.request_id)
        for r, (_, _, _, abort_at) in zip(reqs, specs):
            if abort_at == steps and r.request_id in added and not r.is_finished():
                (done,) = s.finish_requests([r.request_id], RequestStatus.FINISHED_ABORTED)
                assert done is r and s.kv.get_block_ids(r.request_id) == []
                aborted.add(r.request_id)
        s.check_invariants()
        all_arrived = steps >= max(a for _, _, a, _ in specs)
        if all_arrived and not s.has_unfinished_requests():
            break

        running_before = [r.request_id for r in s.running]
        waiting_before = [r.request_id for r in s.waiting]
        decoding = any(not r.paused and r.num_tokens - r.num_computed_tokens == 1
                       for r in s.running)
        out = schedule(s)
        s.check_invariants()
        if running_before or waiting_before:
            assert not out.is_empty, "no progress while requests are unfinished"

        # Budget, max_num_seqs, block tables.
        assert out.total_num_scheduled_tokens == sum(r.num_new_tokens for r in out.scheduled)
        assert out.total_num_scheduled_tokens <= budget
        if prefill_cap is not None and chunked and decoding:
            event("prompt work bounded next to decodes")
            prompt_work = sum(sr.num_new_tokens for sr in out.scheduled
                              if sr.request.num_tokens - sr.num_computed_tokens > 1)
            assert prompt_work <= prefill_cap
        assert len(out.scheduled) <= max_seqs and s.num_running <= max_seqs
        ids = [r.request_id for r in out.scheduled]
        assert len(set(ids)) == len(ids)
        for sr in out.scheduled:
            r = sr.request
            assert sr.num_new_tokens >= 1
            assert sr.num_computed_tokens == r.num_computed_tokens
            end = sr.num_computed_tokens + sr.num_new_tokens
            assert end <= r.num_tokens
            assert sr.sample == (end == r.num_tokens)
            assert len(sr.token_ids) == sr.num_new_tokens
            assert len(sr.block_ids) == cdiv(end, block_size)
            assert sr.block_ids == s.kv.get_block_ids(r.request_id)
        for r in s.waiting:
            assert s.kv.get_block_ids(r.request_id) == []

        # Preemption: victims are the most recently admitted, popped from the end of
        # `running`; they go to the front of `waiting`; no admission in that step.
        pre = out.preempted_request_ids
        if pre:
            event(f"preempted {min(len(pre), 2)}+ in a step")
            assert pre == running_before[::-1][: len(pre)]
            assert [r.request_id for r in s.waiting] == pre[::-1] + waiting_before
            assert ids == running_before[: len(ids)]
            assert [r.request_id for r in s.running] == running_before[: -len(pre)]
            for rid in pre:
                r = s.requests[rid]
                assert r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0
        else:
            # Running requests first (admission order), then admissions (FIFO).
            k = len(running_before)
            assert ids[:k] == running_before[: len(ids[:k])]
            admitted = ids[k:]
            assert admitted == waiting_before[: len(admitted)]
            assert [r.request_id for r in s.running] == running_before + admitted

        sampled = {sr.request_id: token_for(sr.request) for sr in out.scheduled if sr.sample}
        updated = s.update_from_output(out, sampled)
        assert sorted(r.request_id for r in updated) == sorted(sampled)
        s.check_invariants()
        for r in s.running:
            assert len(s.kv.get_block_ids(r.request_id)) == cdiv(r.num_computed_tokens, block_size)
        assert s.kv.block_pool.num_used_blocks == sum(
            len(s.kv.get_block_ids(rid)) for rid in s.requests
        )
        steps += 1
        assert steps <= 2000, "scheduler did not converge"

    event(f"preemptions: {'some' if s.num_preemptions else 'none'}")
    event(f"aborted or rejected: {'some' if aborted else 'none'}")
    for r in reqs:
        if r.request_id in aborted:
            continue
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert r.num_output_tokens == r.max_tokens
        # Preemption never changes what was generated.
        assert r.output_token_ids == [token_for_first(r) + i for i in range(r.max_tokens)]
    assert s.requests == {} and s.num_waiting == 0 and s.num_running == 0
    assert s.kv.num_free_blocks == num_blocks
    assert sorted(s.kv.block_pool.free_queue.block_ids()) == list(range(num_blocks))
    assert all(b.ref_cnt == 0 for b in s.kv.block_pool.blocks)
