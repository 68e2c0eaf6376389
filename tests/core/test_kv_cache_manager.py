"""KVCacheManager: exact block tables, all-or-nothing allocation, reuse order.

Includes a hypothesis state machine over several requests that checks the ref counts
and block counts after every operation.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from pagedlm.core.kv_cache_manager import KVCacheManager, cdiv
from pagedlm.core.request import Request
from pagedlm.sampling_params import SamplingParams


def make_request(rid: str, prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(
        rid,
        list(range(prompt_len)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        seed=0,
    )


def compute(kv: KVCacheManager, req: Request, n: int) -> bool:
    """Reserve slots for `n` more tokens and, on success, mark them computed."""
    ok = kv.allocate_slots(req, n)
    if ok:
        req.num_computed_tokens += n
    return ok


def test_cdiv() -> None:
    assert [cdiv(n, 4) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert cdiv(1, 1) == 1


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=0, block_size=4)


def test_properties() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4)
    assert kv.num_blocks == 5 and kv.num_free_blocks == 5
    assert kv.capacity_tokens == 20
    assert kv.usage() == 0.0
    assert kv.num_allocated_slots() == 0
    assert [kv.num_blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert kv.get_block_ids("nobody") == []


def test_can_ever_fit() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.can_ever_fit(0)
    assert kv.can_ever_fit(1)
    assert kv.can_ever_fit(12)
    assert not kv.can_ever_fit(13)
    # Independent of what is allocated right now.
    compute(kv, make_request("a", 12), 12)
    assert kv.num_free_blocks == 0
    assert kv.can_ever_fit(12) and not kv.can_ever_fit(13)


def test_append_one_token_at_a_time_exact_ids() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    req = make_request("a", 1)
    expected_len = []
    for t in range(1, 17):
        assert compute(kv, req, 1)
        kv.check_invariants([req])
        expected_len.append(len(kv.get_block_ids("a")))
        # A new block exactly when token t-1 starts a new block (t-1 multiple of 4).
        assert kv.get_block_ids("a") == list(range(cdiv(t, 4)))
        assert kv.num_allocated_slots() == 4 * cdiv(t, 4)
    assert expected_len == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    # The cache is full: the 17th token does not fit and nothing changes.
    assert not kv.allocate_slots(req, 1)
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    kv.check_invariants([req])


def test_allocate_is_idempotent_for_already_covered_slots() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    req = make_request("a", 6)
    assert kv.allocate_slots(req, 6)
    assert kv.get_block_ids("a") == [0, 1]
    # Asking again for the same range (e.g. a step that was retried) takes nothing new.
    assert kv.allocate_slots(req, 6)
    assert kv.allocate_slots(req, 8)
    assert kv.get_block_ids("a") == [0, 1]
    assert kv.num_free_blocks == 2
    # Zero new tokens needs nothing.
    assert kv.allocate_slots(make_request("b", 3), 0)
    assert kv.get_block_ids("b") == []
    assert kv.num_free_blocks == 2


def test_prompt_allocation_then_decode() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a, b = make_request("a", 5), make_request("b", 8)
    assert compute(kv, a, 5)
    assert compute(kv, b, 8)
    assert kv.get_block_ids("a") == [0, 1]
    assert kv.get_block_ids("b") == [2, 3]
    kv.check_invariants([a, b])
    # a: tokens 5..7 fit in block 1; token 8 needs block 4.
    for _ in range(3):
        assert compute(kv, a, 1)
    assert kv.get_block_ids("a") == [0, 1]
    assert compute(kv, a, 1)
    assert kv.get_block_ids("a") == [0, 1, 4]
    # b: token 8 needs a new block right away (8 is a multiple of 4).
    assert compute(kv, b, 1)
    assert kv.get_block_ids("b") == [2, 3, 5]
    kv.check_invariants([a, b])
    assert kv.num_free_blocks == 0
    assert kv.usage() == 1.0


def test_all_or_nothing_when_short() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4)
    a, b = make_request("a", 8), make_request("b", 13)
    assert compute(kv, a, 8)  # blocks 0, 1
    kv.check_invariants([a, b])
    # b needs 4 blocks, only 3 free: nothing is taken.
    assert not kv.allocate_slots(b, 13)
    kv.check_invariants([a, b])
    assert kv.get_block_ids("b") == []
    assert kv.num_free_blocks == 3
    # A partial (chunked) allocation that fits succeeds.
    assert compute(kv, b, 12)
    assert kv.get_block_ids("b") == [2, 3, 4]
    # Growing b by one more block fails without touching what b holds.
    assert not kv.allocate_slots(b, 1)
    assert kv.get_block_ids("b") == [2, 3, 4]
    assert kv.num_free_blocks == 0
    kv.check_invariants([a, b])
    # Once a is freed, b grows into a's tail block first.
    kv.free(a)
    kv.check_invariants([b])
    assert compute(kv, b, 1)
    assert kv.get_block_ids("b") == [2, 3, 4, 1]


def test_free_returns_everything_tail_first() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = make_request("a", 9), make_request("b", 4)
    compute(kv, a, 9)  # 0, 1, 2
    compute(kv, b, 4)  # 3
    kv.free(a)
    kv.check_invariants([b])
    assert kv.get_block_ids("a") == []
    assert kv.num_free_blocks == 7
    assert kv.block_pool.free_queue.block_ids() == [4, 5, 6, 7, 2, 1, 0]
    kv.free(b)
    kv.check_invariants([])
    assert kv.block_pool.free_queue.block_ids() == [4, 5, 6, 7, 2, 1, 0, 3]
    assert kv.num_allocated_slots() == 0
    # Reuse follows the queue: never-used blocks, then a's tail, ..., then b's.
    c = make_request("c", 32)
    assert compute(kv, c, 32)
    assert kv.get_block_ids("c") == [4, 5, 6, 7, 2, 1, 0, 3]
    kv.check_invariants([c])


def test_free_unknown_and_twice_is_harmless() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", 4)
    kv.free(a)  # never allocated
    compute(kv, a, 4)
    kv.free(a)
    kv.free(a)  # the table is gone; no double free in the pool
    kv.check_invariants([])
    assert kv.num_free_blocks == 3


def test_failed_allocation_then_free_leaks_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a, b = make_request("a", 8), make_request("b", 4)
    compute(kv, a, 8)
    assert not kv.allocate_slots(b, 4)
    kv.free(b)
    kv.free(a)
    kv.check_invariants([])
    assert kv.num_free_blocks == 2
    assert kv.req_to_blocks == {}


def test_preempt_and_reallocate_gets_recycled_ids() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a, b = make_request("a", 4), make_request("b", 8)
    compute(kv, a, 4)  # [0]
    compute(kv, b, 8)  # [1, 2]
    # Preempt b (recompute): free, reset progress, allocate again.
    kv.free(b)
    b.num_computed_tokens = 0
    assert kv.block_pool.free_queue.block_ids() == [3, 2, 1]
    assert compute(kv, b, 8)
    assert kv.get_block_ids("b") == [3, 2]
    kv.check_invariants([a, b])


def test_num_allocated_slots_counts_whole_blocks() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a, b = make_request("a", 1), make_request("b", 5)
    compute(kv, a, 1)
    assert kv.num_allocated_slots() == 4
    compute(kv, b, 5)
    assert kv.num_allocated_slots() == 12
    assert kv.usage() == pytest.approx(3 / 6)
    kv.free(a)
    assert kv.num_allocated_slots() == 8


def test_check_invariants_detects_dead_holder_and_short_table() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", 8)
    compute(kv, a, 8)
    with pytest.raises(AssertionError, match="dead requests"):
        kv.check_invariants([])
    a.num_computed_tokens = 9  # claims a token with no slot
    with pytest.raises(AssertionError):
        kv.check_invariants([a])


# ----- property-based --------------------------------------------------------------------

BLOCK_SIZE = 4
NUM_BLOCKS = 7


class KVCacheMachine(RuleBasedStateMachine):
    """Random add / allocate prompt / append / free / abort over several requests.

    The model: for each live request, the number of tokens it has slots for.
    """

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
        self.live: dict[str, Request] = {}
        self.tokens: dict[str, int] = {}
        self.next_id = 0

    @rule(target=requests, prompt_len=st.integers(1, 20))
    def add_request(self, prompt_len: int) -> str:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.live[rid] = make_request(rid, prompt_len)
        self.tokens[rid] = 0
        return rid

    def _compute(self, rid: str, n: int) -> None:
        req = self.live[rid]
        free_before = self.kv.num_free_blocks
        table_before = self.kv.get_block_ids(rid)
        needed = cdiv(self.tokens[rid] + n, BLOCK_SIZE) - len(table_before)
        ok = compute(self.kv, req, n)
        assert ok == (needed <= free_before)
        if ok:
            self.tokens[rid] += n
            after = self.kv.get_block_ids(rid)
            # Existing blocks are kept; new ones come from the front of the queue.
            assert after[: len(table_before)] == table_before
            assert len(after) - len(table_before) == max(needed, 0)
        else:
            # All or nothing.
            assert self.kv.get_block_ids(rid) == table_before
            assert self.kv.num_free_blocks == free_before

    @rule(rid=requests)
    def allocate_prompt(self, rid: str) -> None:
        if rid not in self.live or self.tokens[rid] != 0:
            return
        self._compute(rid, self.live[rid].num_prompt_tokens)

    @rule(rid=requests, n=st.integers(1, 6))
    def append_tokens(self, rid: str, n: int) -> None:
        if rid not in self.live or self.tokens[rid] == 0:
            return
        self._compute(rid, n)

    @rule(rid=consumes(requests))
    def free(self, rid: str) -> None:
        if rid not in self.live:
            return
        req = self.live.pop(rid)
        table = self.kv.get_block_ids(rid)
        queue_before = self.kv.block_pool.free_queue.block_ids()
        self.kv.free(req)
        del self.tokens[rid]
        # Freed blocks go to the back of the queue, tail first.
        assert self.kv.block_pool.free_queue.block_ids() == queue_before + table[::-1]

    @rule(rid=consumes(requests))
    def abort(self, rid: str) -> None:
        # Abort (or preemption) mid-flight: same as free, but also resets progress.
        if rid not in self.live:
            return
        req = self.live.pop(rid)
        del self.tokens[rid]
        self.kv.free(req)
        req.num_computed_tokens = 0
        assert self.kv.get_block_ids(rid) == []

    @precondition(lambda self: bool(self.live))
    @rule()
    def free_all(self) -> None:
        for req in list(self.live.values()):
            self.kv.free(req)
        self.live.clear()
        self.tokens.clear()
        assert self.kv.num_free_blocks == NUM_BLOCKS
        assert sorted(self.kv.block_pool.free_queue.block_ids()) == list(range(NUM_BLOCKS))

    @invariant()
    def consistent(self) -> None:
        kv = self.kv
        pool = kv.block_pool
        pool.check_invariants()
        kv.check_invariants(list(self.live.values()))
        assert pool.num_free_blocks + pool.num_used_blocks == NUM_BLOCKS
        # Every ref count equals the number of block tables containing the block.
        counts = [0] * NUM_BLOCKS
        for rid in self.live:
            for bid in kv.get_block_ids(rid):
                counts[bid] += 1
        assert [b.ref_cnt for b in pool.blocks] == counts
        assert pool.num_used_blocks == sum(1 for c in counts if c)
        # Blocks held == ceil(tokens / block_size); no table shared (no prefix caching).
        for rid, n in self.tokens.items():
            assert len(kv.get_block_ids(rid)) == cdiv(n, BLOCK_SIZE)
            assert self.live[rid].num_computed_tokens == n
        assert max(counts, default=0) <= 1
        assert kv.num_allocated_slots() == BLOCK_SIZE * pool.num_used_blocks

    def teardown(self) -> None:
        for req in self.live.values():
            self.kv.free(req)
        self.kv.check_invariants([])
        assert self.kv.num_free_blocks == NUM_BLOCKS
        assert sorted(self.kv.block_pool.free_queue.block_ids()) == list(range(NUM_BLOCKS))
        assert all(b.ref_cnt == 0 for b in self.kv.block_pool.blocks)


KVCacheMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheMachine = KVCacheMachine.TestCase
