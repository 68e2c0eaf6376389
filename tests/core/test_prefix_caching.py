"""Prefix caching, forking and copy-on-write in the KV cache manager and scheduler.

Tiny configs, exact block ids, invariants after every operation. "Computing" a step is
simulated by advancing num_computed_tokens and registering full blocks, as the
scheduler does after the model ran.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedlm.config import SchedulerConfig
from pagedlm.core.block_hash import hash_block
from pagedlm.core.kv_cache_manager import KVCacheManager
from pagedlm.core.request import Request, RequestStatus
from pagedlm.core.scheduler import Scheduler
from pagedlm.sampling_params import SamplingParams
from tests.core.step_view import schedule

BS = 4


def req(rid, tokens, max_tokens=4, **kw):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=0,
                   max_tokens=max_tokens, **kw)


def admit(kv: KVCacheManager, r: Request) -> list[int]:
    """Allocate the whole prompt (with prefix hits) and 'compute' it."""
    hits = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - len(hits) * BS, hits)
    r.num_computed_tokens = r.num_tokens
    kv.cache_blocks(r, r.num_tokens)
    kv.check_invariants()
    return [b.block_id for b in hits]


def ids(kv, r):
    return kv.get_block_ids(r.request_id)


def test_hits_reuse_exact_blocks_and_count_refs():
    kv = KVCacheManager(10, BS, enable_caching=True)
    a = req("a", range(10))  # blocks 0, 1 full; 2 partial
    assert admit(kv, a) == []
    assert ids(kv, a) == [0, 1, 2]
    b = req("b", [*range(8), 99, 98, 97])
    assert admit(kv, b) == [0, 1]
    assert ids(kv, b) == [0, 1, 3]
    pool = kv.block_pool
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert kv.num_shared_blocks() == 2


def test_last_token_is_always_computed():
    kv = KVCacheManager(10, BS, enable_caching=True)
    admit(kv, req("a", range(8)))
    b = req("b", range(8))  # all 8 tokens cached, but the 8th must be computed for logits
    assert [blk.block_id for blk in kv.get_computed_blocks(b)] == [0]
    c = req("c", range(9))
    assert [blk.block_id for blk in kv.get_computed_blocks(c)] == [0, 1]


def test_chain_and_salt_key_the_content():
    kv = KVCacheManager(10, BS, enable_caching=True)
    admit(kv, req("a", range(12)))
    # Same second block, different first block: the chain makes it a miss.
    assert kv.get_computed_blocks(req("b", [7, 1, 2, 3, 4, 5, 6, 7, 8, 9])) == []
    # Same tokens under another cache salt: a miss.
    assert kv.get_computed_blocks(req("c", range(12), cache_salt="tenant-2")) == []
    assert len(kv.get_computed_blocks(req("d", range(12)))) == 2
    # The hash is SHA-256 over (parent, extra key, tokens): 32 bytes, order-sensitive.
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    assert len(hash_block(None, [1, 2])) == 32


def test_freed_blocks_stay_cached_and_evict_tail_first():
    kv = KVCacheManager(10, BS, enable_caching=True)
    a = req("a", range(10))
    admit(kv, a)  # [0, 1, 2]
    kv.free(a)
    kv.check_invariants()
    # Freed tail first: the queue ends ..., 2, 1, 0; cached blocks 0 and 1 stay findable.
    assert kv.block_pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert kv.block_pool.num_free_blocks == 10
    b = req("b", range(10))
    assert admit(kv, b) == [0, 1]  # claimed back from the free queue
    assert ids(kv, b) == [0, 1, 3]
    kv.free(b)
    assert kv.block_pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    # Fill the pool with unrelated content: never-used blocks go first, then the
    # chain's tail (block 1) is evicted before its head (block 0).
    c = req("c", [50 + i for i in range(4 * 8)], max_tokens=1)
    assert kv.allocate_slots(c, 32)
    assert ids(kv, c) == [4, 5, 6, 7, 8, 9, 2, 3]
    assert kv.block_pool.get_cached_block(b.block_hashes[0]) is not None
    d = req("d", [90, 91, 92, 93], max_tokens=1)
    assert kv.allocate_slots(d, 4)
    assert ids(kv, d) == [1]
    assert kv.block_pool.get_cached_block(b.block_hashes[1]) is None  # evicted
    assert kv.block_pool.get_cached_block(b.block_hashes[0]) is not None
    assert kv.block_pool.num_evictions == 1
    kv.check_invariants()


def test_allocation_counts_free_hits_as_used():
    kv = KVCacheManager(3, BS, enable_caching=True)
    a = req("a", range(9))  # blocks 0, 1 full, 2 partial
    admit(kv, a)
    kv.free(a)
    b = req("b", [*range(8), 5, 5, 5, 5, 5])  # hits 0, 1; needs 2 more blocks, only 1 left
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 2
    assert not kv.allocate_slots(b, b.num_tokens - 8, hits)
    kv.check_invariants()
    assert [blk.ref_cnt for blk in kv.block_pool.blocks] == [0, 0, 0]


def test_fork_shares_blocks_and_copies_the_partial_block_once_per_writer():
    kv = KVCacheManager(10, BS, enable_caching=True)
    parent = req("p", range(6))  # [0 full, 1 partial (2 tokens)]
    admit(kv, parent)
    children = [req(f"c{i}", range(6)) for i in range(3)]
    for c in children:
        kv.fork(parent, c)
        c.num_computed_tokens = parent.num_computed_tokens
    kv.check_invariants()
    assert [b.ref_cnt for b in kv.block_pool.blocks[:2]] == [4, 4]
    # Each child writes its 7th token into the shared partial block: private copies.
    for i, c in enumerate(children):
        c.append_output_token(100 + i)
        assert kv.allocate_slots(c, 1)
        kv.check_invariants()
    assert kv.take_pending_copies() == [(1, 2), (1, 3), (1, 4)]
    assert [ids(kv, c) for c in children] == [[0, 2], [0, 3], [0, 4]]
    # The last holder writes in place; the full block 0 was never copied.
    parent.append_output_token(99)
    assert kv.allocate_slots(parent, 1)
    assert kv.take_pending_copies() == []
    assert ids(kv, parent) == [0, 1]
    assert kv.block_pool.blocks[0].ref_cnt == 4 and kv.block_pool.blocks[1].ref_cnt == 1
    for r in [parent, *children]:
        kv.free(r)
    kv.check_invariants()
    assert kv.num_free_blocks == 10


def test_fork_at_block_boundary_copies_nothing():
    kv = KVCacheManager(10, BS, enable_caching=False)
    parent = req("p", range(8))
    admit(kv, parent)
    child = req("c", range(8))
    kv.fork(parent, child)
    child.num_computed_tokens = 8
    child.append_output_token(1)
    assert kv.allocate_slots(child, 1)
    assert kv.take_pending_copies() == []
    assert ids(kv, child) == [0, 1, 2]


def _drive(sched: Scheduler, token=7, max_steps=500):
    """Run the scheduler with a fake model; returns every SchedulerOutput."""
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        out = schedule(sched)
        assert not out.is_empty, "no progress"
        sampled = {}
        for s in out.scheduled:
            if s.sample:
                for r in [s.request, *s.forks]:
                    sampled[r.request_id] = token + len(r.output_token_ids)
        sched.update_from_output(out, sampled)
        sched.check_invariants()
        outs.append(out)
    raise AssertionError("did not finish")


def test_scheduler_forks_n_samples_from_one_prompt_computation():
    kv = KVCacheManager(20, BS, enable_caching=True)
    sched = Scheduler(SchedulerConfig(8, 64, 64), kv)
    leader = req("0_x", range(10), max_tokens=3)
    followers = [req(f"{i}_x", range(10), max_tokens=3) for i in (1, 2, 3)]
    sched.add_request(leader)
    sched.add_forked_requests(leader, followers)
    outs = _drive(sched)
    first = outs[0]
    assert first.total_num_scheduled_tokens == 10  # the prompt, once
    assert [r.request_id for r in first.scheduled[0].forks] == ["1_x", "2_x", "3_x"]
    second = outs[1]
    assert sorted(s.request_id for s in second.scheduled) == ["0_x", "1_x", "2_x", "3_x"]
    assert len(second.copy_blocks) == 3  # the partial prompt block, once per extra writer
    for r in [leader, *followers]:
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(r.output_token_ids) == 3
    assert kv.num_free_blocks == 20


def test_scheduler_defers_forks_beyond_max_num_seqs():
    kv = KVCacheManager(40, BS, enable_caching=True)
    sched = Scheduler(SchedulerConfig(2, 64, 64), kv)
    leader = req("0_x", range(9), max_tokens=2)
    followers = [req(f"{i}_x", range(9), max_tokens=2) for i in (1, 2, 3)]
    sched.add_request(leader)
    sched.add_forked_requests(leader, followers)
    _drive(sched)
    # One follower forked, two became ordinary requests that hit the prompt's full blocks.
    assert sched.prefix_cache_hits == 2 * 8
    assert all(len(r.output_token_ids) == 2 for r in [leader, *followers])
    assert kv.num_free_blocks == 40


def test_abort_pending_fork_and_leader():
    kv = KVCacheManager(20, BS, enable_caching=True)
    sched = Scheduler(SchedulerConfig(8, 4, 64), kv)  # budget 4: the prompt takes 3 steps
    leader = req("0_x", range(10))
    followers = [req(f"{i}_x", range(10)) for i in (1, 2)]
    sched.add_request(leader)
    sched.add_forked_requests(leader, followers)
    out = schedule(sched)
    sched.update_from_output(out, {})
    sched.finish_requests(["1_x"], RequestStatus.FINISHED_ABORTED)
    sched.check_invariants()
    assert [f.request_id for f in sched.pending_forks["0_x"]] == ["2_x"]
    sched.finish_requests(["0_x", "2_x"], RequestStatus.FINISHED_ABORTED)
    sched.check_invariants()
    assert not sched.has_unfinished_requests() and kv.num_free_blocks == 20


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_random_workloads_hits_hold_the_right_tokens(data):
    """Whatever the interleaving, a block found in the cache holds exactly the tokens the
    request expects there, ref counts stay exact, and nothing leaks."""
    num_blocks = data.draw(st.integers(4, 24))
    kv = KVCacheManager(num_blocks, BS, enable_caching=True)
    content: dict[int, tuple[int, ...]] = {}  # block id -> tokens last written there
    live: list[Request] = []
    prefixes = [list(range(k)) for k in (0, 3, 4, 8, 9)]
    for step in range(data.draw(st.integers(1, 25))):
        if live and data.draw(st.booleans()):
            r = live.pop(data.draw(st.integers(0, len(live) - 1)))
            kv.free(r)
        else:
            prefix = data.draw(st.sampled_from(prefixes))
            tail = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=9))
            r = req(f"r{step}", prefix + tail)
            hits = kv.get_computed_blocks(r)
            for i, blk in enumerate(hits):
                assert content[blk.block_id] == tuple(r.all_token_ids[i * BS : (i + 1) * BS])
            if not kv.allocate_slots(r, r.num_tokens - len(hits) * BS, hits):
                kv.free(r)
                kv.check_invariants()
                continue
            start = len(hits) * BS
            for pos in range(start, r.num_tokens):
                blk = kv.req_to_blocks[r.request_id][pos // BS]
                off = pos % BS
                old = list(content.get(blk.block_id, ()))[:off]
                content[blk.block_id] = tuple(old + [r.all_token_ids[pos]])
            r.num_computed_tokens = r.num_tokens
            kv.cache_blocks(r, r.num_tokens)
            live.append(r)
        kv.check_invariants(live)
    for r in live:
        kv.free(r)
    kv.check_invariants([])
    assert kv.num_free_blocks == num_blocks


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_random_forks_appends_and_frees_keep_contents_and_counts_exact(data):
    """Fork, append (with copy-on-write), free in any order: every table still reads back
    exactly its own tokens, ref counts stay exact, and everything returns to the pool."""
    num_blocks = data.draw(st.integers(6, 30))
    kv = KVCacheManager(num_blocks, BS, enable_caching=data.draw(st.booleans()))
    content: dict[int, list[int]] = {}  # block id -> tokens written there (shadow cache)
    live: list[Request] = []
    counter = 0

    def write(r: Request, start: int) -> None:
        for pos in range(start, r.num_tokens):
            blk = kv.req_to_blocks[r.request_id][pos // BS]
            slot = content.setdefault(blk.block_id, [])
            del slot[pos % BS :]
            slot.append(r.all_token_ids[pos])

    def apply_copies() -> None:
        for src, dst in kv.take_pending_copies():
            content[dst] = list(content.get(src, []))

    def check(r: Request) -> None:
        blocks = kv.req_to_blocks[r.request_id]
        for pos in range(r.num_computed_tokens):
            assert content[blocks[pos // BS].block_id][pos % BS] == r.all_token_ids[pos], (r, pos)

    for _ in range(data.draw(st.integers(1, 30))):
        op = data.draw(st.sampled_from(["new", "fork", "append", "free"]))
        if op == "new" or not live:
            counter += 1
            r = req(f"r{counter}", data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=10)))
            hits = kv.get_computed_blocks(r)
            if kv.allocate_slots(r, r.num_tokens - len(hits) * BS, hits):
                apply_copies()
                write(r, len(hits) * BS)
                r.num_computed_tokens = r.num_tokens
                kv.cache_blocks(r, r.num_tokens)
                live.append(r)
            else:
                kv.free(r)
        elif op == "fork":
            parent = data.draw(st.sampled_from(live))
            counter += 1
            child = req(f"r{counter}", parent.prompt_token_ids)
            child.output_token_ids = list(parent.output_token_ids)
            child.all_token_ids = list(parent.all_token_ids)
            kv.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            live.append(child)
        elif op == "append":
            r = data.draw(st.sampled_from(live))
            r.append_output_token(data.draw(st.integers(4, 9)))
            if kv.allocate_slots(r, 1):
                apply_copies()
                write(r, r.num_computed_tokens)
                r.num_computed_tokens += 1
                kv.cache_blocks(r, r.num_computed_tokens)
            else:  # no room: drop the token again, as a preempted request would recompute
                r.output_token_ids.pop()
                r.all_token_ids.pop()
        else:
            r = live.pop(data.draw(st.integers(0, len(live) - 1)))
            kv.free(r)
        kv.check_invariants(live)
        for r in live:
            check(r)
    for r in live:
        kv.free(r)
    kv.check_invariants([])
    assert kv.num_free_blocks == num_blocks
