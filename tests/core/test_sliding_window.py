"""Sliding-window block freeing in the KV cache manager and the scheduler.

With a window W shared by every layer, a block whose last token j has
j <= num_computed_tokens - W is invisible to every future query: `allocate_slots`
returns it to the pool and puts the null block (block 0, reserved) in its place.
Tiny configs, exact block ids, invariants after every operation.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedlm.config import SchedulerConfig
from pagedlm.core.block_pool import BlockPool
from pagedlm.core.kv_cache_manager import KVCacheManager, cdiv
from pagedlm.core.request import Request
from pagedlm.core.scheduler import Scheduler
from pagedlm.sampling_params import SamplingParams
from tests.core.step_view import schedule

BS = 4


def req(rid: str, tokens, max_tokens: int = 64) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=0,
                   max_tokens=max_tokens)


def step(kv: KVCacheManager, r: Request, n: int, hits=()) -> None:
    """Allocate and 'compute' n tokens (after hits), registering full blocks as the scheduler does."""
    assert kv.allocate_slots(r, n, hits)
    r.num_computed_tokens += len(hits) * kv.block_size
    kv.cache_blocks(r, r.num_computed_tokens + n)
    r.num_computed_tokens += n
    kv.check_invariants()


def ids(kv: KVCacheManager, r: Request) -> list[int]:
    return kv.get_block_ids(r.request_id)


def num_invisible(num_computed: int, window: int, bs: int = BS) -> int:
    """Blocks whose last position (i + 1) * bs - 1 is <= num_computed - window."""
    return sum(1 for i in range(cdiv(num_computed, bs)) if (i + 1) * bs - 1 <= num_computed - window)


def test_null_block_is_reserved_and_never_handed_out() -> None:
    pool = BlockPool(4, reserve_null_block=True)
    assert pool.null_block is pool.blocks[0] and pool.null_block.ref_cnt == 1
    assert pool.num_free_blocks == 3 and pool.num_usable_blocks == 3 and pool.num_used_blocks == 0
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
    assert pool.usage() == 1.0
    pool.check_invariants()
    with pytest.raises(AssertionError):
        pool.free_blocks([pool.null_block])
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1, reserve_null_block=True)
    kv = KVCacheManager(5, BS, sliding_window=8)
    assert kv.num_blocks == 4 and kv.num_free_blocks == 4 and kv.capacity_tokens == 16
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(5, BS, sliding_window=0)


def test_decode_frees_blocks_behind_the_window_exact_ids() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, sliding_window=6)
    r = req("a", range(10))
    step(kv, r, 10)
    assert ids(kv, r) == [1, 2, 3]
    # Next query at 10 sees 5..10: block 0 (positions 0-3) is invisible.
    step(kv, r, 1)
    assert ids(kv, r) == [0, 2, 3]
    assert kv.block_pool.free_queue.block_ids() == [4, 5, 6, 7, 1]
    for _ in range(4):  # positions 11..14; at 13 block 1 (4-7, last 7 <= 13 - 6) goes
        step(kv, r, 1)
    assert r.num_computed_tokens == 15
    assert ids(kv, r) == [0, 0, 3, 4]
    assert kv.block_pool.free_queue.block_ids() == [5, 6, 7, 1, 2]
    # A long run holds at most cdiv(W, bs) + 1 blocks at a decode step.
    for _ in range(100):
        step(kv, r, 1)
        held = kv.num_held_blocks("a")
        assert held <= cdiv(6, BS) + 1
        assert len(ids(kv, r)) - held == num_invisible(r.num_computed_tokens - 1, 6)
    kv.free(r)
    kv.check_invariants([])
    assert kv.num_free_blocks == kv.num_blocks == 7


def test_window_of_exactly_one_block() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, sliding_window=BS)
    r = req("a", range(4))
    step(kv, r, 4)
    step(kv, r, 1)  # query 4 sees 1..4: block 0 still visible (positions 1-3)
    assert ids(kv, r) == [1, 2]
    step(kv, r, 3)  # positions 5..7
    step(kv, r, 1)  # query 8 sees 5..8: block 0 invisible
    assert ids(kv, r) == [0, 2, 3]


def test_chunked_prefill_frees_between_chunks_only_what_no_chunk_query_sees() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS, sliding_window=5)
    r = req("a", range(30))
    step(kv, r, 12)
    assert ids(kv, r) == [1, 2, 3]
    step(kv, r, 8)  # queries 12..19 see from 8: blocks 0, 1 (last pos 7 <= 12 - 5) go
    assert ids(kv, r) == [0, 0, 3, 4, 5]
    step(kv, r, 10)  # queries 20..29 see from 16
    assert ids(kv, r) == [0, 0, 0, 0, 5, 6, 7, 8]


def test_all_or_nothing_still_frees_invisible_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, sliding_window=4)
    r = req("a", range(12))
    step(kv, r, 12)
    assert ids(kv, r) == [1, 2, 3] and kv.num_free_blocks == 0
    # 8 more tokens need 2 new blocks; blocks 0 and 1 fall out of the window (12 - 4 = 8).
    assert kv.allocate_slots(r, 8)
    assert ids(kv, r) == [0, 0, 3, 2, 1]
    kv.check_invariants([r])
    r.num_computed_tokens = 20
    assert not kv.allocate_slots(r, 12)  # short: 3 more needed, 2 freed (blocks 2, 3)
    assert ids(kv, r) == [0, 0, 0, 0, 1]
    kv.check_invariants([r])


def test_max_blocks_held_bounds_long_requests() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS, sliding_window=8)
    assert kv.max_blocks_held(1000, 1) == cdiv(8, BS) + 1
    assert kv.max_blocks_held(1000, 16) == cdiv(16 + 7, BS) + 1
    assert kv.max_blocks_held(5, 16) == 2  # never more than the whole sequence
    assert kv.can_ever_fit(100_000, 8) and not kv.can_ever_fit(100_000, 32)
    plain = KVCacheManager(num_blocks=6, block_size=BS)
    assert plain.max_blocks_held(1000, 1) == 250 and not plain.can_ever_fit(1000, 1)


def test_prefix_hits_behind_the_window_are_not_referenced() -> None:
    kv = KVCacheManager(num_blocks=12, block_size=BS, enable_caching=True, sliding_window=6)
    a = req("a", range(17))
    step(kv, a, 17)
    step(kv, a, 1)  # blocks 0..2 (last pos 11 <= 17 - 6) freed, still cached
    assert ids(kv, a) == [0, 0, 0, 4, 5]
    b = req("b", range(17))
    hits = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [1, 2, 3, 4]
    step(kv, b, 1, hits)  # computed 16: blocks 0, 1 invisible (last 7 <= 10); 2 (8-11) visible
    assert ids(kv, b) == [0, 0, 3, 4, 6]
    assert kv.block_pool.blocks[1].ref_cnt == 0 and kv.block_pool.blocks[3].ref_cnt == 1
    kv.check_invariants([a, b])
    kv.free(a)
    kv.free(b)
    kv.check_invariants([])
    assert kv.num_free_blocks == 11


def test_evicted_early_block_stops_the_lookup() -> None:
    """A freed block that is reused for other content leaves the cache, and the chained
    lookup stops there: no hit can name a block whose content was overwritten."""
    kv = KVCacheManager(num_blocks=7, block_size=BS, enable_caching=True, sliding_window=4)
    a = req("a", range(100, 112))
    step(kv, a, 12)
    step(kv, a, 1)  # block 0, 1 (last 7 <= 12 - 4) freed: queue [4, 5, 6, 2, 1]
    assert ids(kv, a) == [0, 0, 3, 4]
    other = req("o", range(500, 516))
    step(kv, other, 16)  # takes 5, 6, 2, 1 (after 4 went to a): evicts a's first two blocks
    assert kv.block_pool.blocks[1].block_hash is not None  # now holds o's content
    b = req("b", range(100, 113))
    assert kv.get_computed_blocks(b) == []  # block 0's hash is gone: no hits at all
    kv.check_invariants([a, other])


def test_fork_shares_null_prefix_and_counts_exactly() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS, sliding_window=5)
    parent = req("p", range(14))
    step(kv, parent, 14)
    step(kv, parent, 1)  # block 0, 1 (last 7 <= 14 - 5) freed
    assert ids(kv, parent) == [0, 0, 3, 4]
    child = req("c", range(15))
    kv.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens
    assert ids(kv, child) == [0, 0, 3, 4]
    assert kv.block_pool.blocks[4].ref_cnt == 2
    kv.check_invariants([parent, child])
    # The shared partial block is copied on write; windows advance independently.
    step(kv, child, 1)
    assert kv.take_pending_copies() == [(4, 5)]
    assert ids(kv, child) == [0, 0, 3, 5]
    for _ in range(6):
        step(kv, child, 1)
    kv.check_invariants([parent, child])
    assert ids(kv, child)[:3] == [0, 0, 0] and kv.block_pool.blocks[3].ref_cnt == 1
    kv.free(parent)
    kv.free(child)
    kv.check_invariants([])
    assert kv.num_free_blocks == 9


def test_scheduler_runs_generations_far_longer_than_the_cache() -> None:
    """Without a window these requests could never fit; with one they run to the end
    without preemption, each holding a bounded number of blocks."""
    window, num_blocks, budget = 8, 16, 8  # 3 requests x at most 5 blocks each
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BS, enable_caching=True, sliding_window=window)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=10_000,
                                  enable_chunked_prefill=True), kv)
    requests = [req(f"r{i}", range(i, i + 13), max_tokens=90) for i in range(3)]
    for r in requests:
        s.add_request(r)
    steps = 0
    while s.has_unfinished_requests():
        out = schedule(s)
        s.check_invariants()
        for sched in out.scheduled:
            held = kv.num_held_blocks(sched.request_id)
            assert held <= kv.max_blocks_held(sched.request.max_num_tokens, budget)
        s.update_from_output(out, {x.request_id: 7 for x in out.scheduled if x.sample})
        s.check_invariants()
        steps += 1
        assert steps < 1000
    assert s.num_preemptions == 0
    assert all(r.num_output_tokens == 90 for r in requests)
    assert kv.num_free_blocks == kv.num_blocks
    with pytest.raises(ValueError, match="whole KV cache"):
        Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=10_000,
                                  enable_chunked_prefill=True), kv).add_request(req("big", range(60)))


class WindowMachine(RuleBasedStateMachine):
    """Random admit (with prefix hits) / step / fork / preempt / finish under a window.

    After every operation: exact ref counts, no leak, nulls a prefix of each table; after
    every allocation, exactly the invisible blocks are null.
    """

    def __init__(self) -> None:
        super().__init__()
        self.window = 6
        self.kv = KVCacheManager(num_blocks=12, block_size=BS, enable_caching=True,
                                 sliding_window=self.window)
        self.live: dict[str, Request] = {}
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _check_freed(self, r: Request, num_computed: int) -> None:
        table = self.kv.req_to_blocks[r.request_id]
        num_null = len(table) - self.kv.num_held_blocks(r.request_id)
        assert num_null == min(len(table), num_invisible(num_computed, self.window)), (table, num_computed)

    @rule(prefix=st.sampled_from([0, 1, 2]), length=st.integers(1, 30), chunk=st.integers(1, 12))
    def admit(self, prefix: int, length: int, chunk: int) -> None:
        # Prompts share one of three token streams, so prefix hits happen.
        r = req(self._new_id(), range(prefix * 1000, prefix * 1000 + length))
        hits = self.kv.get_computed_blocks(r)
        n = min(chunk, r.num_tokens - len(hits) * BS)
        if not self.kv.allocate_slots(r, n, hits):
            self.kv.free(r)
            return
        r.num_computed_tokens = len(hits) * BS
        self._check_freed(r, r.num_computed_tokens)
        self.kv.cache_blocks(r, r.num_computed_tokens + n)
        r.num_computed_tokens += n
        self.live[r.request_id] = r

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), n=st.integers(1, 8))
    def advance(self, data: st.DataObject, n: int) -> None:
        r = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if r.num_computed_tokens == r.num_tokens:
            r.append_output_token(7 + r.num_tokens)
        n = min(n, r.num_tokens - r.num_computed_tokens)
        if self.kv.allocate_slots(r, n):
            self._check_freed(r, r.num_computed_tokens)
            self.kv.cache_blocks(r, r.num_computed_tokens + n)
            r.num_computed_tokens += n

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        child = req(self._new_id(), parent.all_token_ids[: parent.num_computed_tokens] or [1])
        if parent.num_computed_tokens == 0:
            return
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.live[child.request_id] = child

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def finish_or_preempt(self, data: st.DataObject) -> None:
        r = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(r)
        r.num_computed_tokens = 0

    @invariant()
    def consistent(self) -> None:
        self.kv.check_invariants(list(self.live.values()))
        null = self.kv.null_block
        held = {b.block_id for blocks in self.kv.req_to_blocks.values() for b in blocks if b is not null}
        assert self.kv.num_free_blocks == self.kv.num_blocks - len(held)
        if not self.live:
            assert self.kv.num_free_blocks == self.kv.num_blocks


TestWindowMachine = WindowMachine.TestCase
TestWindowMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
