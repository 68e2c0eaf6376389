"""BlockPool and FreeBlockQueue: exact block ids, reuse order, ref counts."""

from __future__ import annotations

import pytest

from pagedlm.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def make_queue(n: int) -> tuple[list[KVCacheBlock], FreeBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeBlockQueue(blocks)


# ----- FreeBlockQueue --------------------------------------------------------------------


def test_queue_initial_order_and_count() -> None:
    blocks, q = make_queue(5)
    assert q.block_ids() == [0, 1, 2, 3, 4]
    assert q.num_free_blocks == 5
    assert ids(q) == [0, 1, 2, 3, 4]


def test_queue_popleft_order_then_empty() -> None:
    _, q = make_queue(3)
    popped = [q.popleft().block_id for _ in range(3)]
    assert popped == [0, 1, 2]
    assert q.num_free_blocks == 0
    assert q.block_ids() == []
    with pytest.raises(IndexError):
        q.popleft()
    assert q.num_free_blocks == 0


def test_queue_popleft_unlinks_block() -> None:
    _, q = make_queue(2)
    b = q.popleft()
    assert b.prev_free is None and b.next_free is None


def test_queue_remove_middle_head_tail() -> None:
    blocks, q = make_queue(6)
    q.remove(blocks[3])
    assert q.block_ids() == [0, 1, 2, 4, 5]
    assert blocks[3].prev_free is None and blocks[3].next_free is None
    q.remove(blocks[0])
    assert q.block_ids() == [1, 2, 4, 5]
    q.remove(blocks[5])
    assert q.block_ids() == [1, 2, 4]
    assert q.num_free_blocks == 3
    assert q.popleft().block_id == 1


def test_queue_remove_only_block() -> None:
    blocks, q = make_queue(1)
    q.remove(blocks[0])
    assert q.block_ids() == [] and q.num_free_blocks == 0
    q.append(blocks[0])
    assert q.block_ids() == [0]


def test_queue_append_goes_to_back() -> None:
    blocks, q = make_queue(4)
    a = q.popleft()
    b = q.popleft()
    q.append(b)
    q.append(a)
    assert q.block_ids() == [2, 3, 1, 0]
    assert q.num_free_blocks == 4
    q.remove(blocks[3])
    q.append(blocks[3])
    assert q.block_ids() == [2, 1, 0, 3]


def test_queue_rejects_linked_block_and_unlinked_removal() -> None:
    blocks, q = make_queue(3)
    with pytest.raises(AssertionError):
        q.append(blocks[1])  # still linked in the queue
    b = q.popleft()
    with pytest.raises(AssertionError):
        q.remove(b)  # not in the queue
    assert q.block_ids() == [1, 2] and q.num_free_blocks == 2


def test_queue_iteration_is_a_snapshot_of_links() -> None:
    blocks, q = make_queue(4)
    # Walk forward through links and backward from the tail: both agree.
    fwd = q.block_ids()
    back = []
    node = q._tail.prev_free
    while node is not q._head:
        back.append(node.block_id)
        node = node.prev_free
    assert back == fwd[::-1]


# ----- BlockPool -------------------------------------------------------------------------


def test_pool_rejects_empty() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_pool_initial_state() -> None:
    pool = BlockPool(8)
    pool.check_invariants()
    assert pool.free_queue.block_ids() == list(range(8))
    assert pool.num_free_blocks == 8 and pool.num_used_blocks == 0
    assert pool.usage() == 0.0
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)
    assert [b.block_id for b in pool.blocks] == list(range(8))


def test_get_new_blocks_from_front_with_refcount_one() -> None:
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)
    pool.check_invariants()
    assert ids(a) == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in a)
    assert all(b is pool.blocks[b.block_id] for b in a)
    b = pool.get_new_blocks(2)
    pool.check_invariants()
    assert ids(b) == [3, 4]
    assert pool.free_queue.block_ids() == [5, 6, 7]
    assert pool.num_used_blocks == 5 and pool.num_free_blocks == 3
    assert pool.usage() == pytest.approx(5 / 8)


def test_get_new_blocks_zero_and_too_many() -> None:
    pool = BlockPool(4)
    assert pool.get_new_blocks(0) == []
    pool.get_new_blocks(3)
    with pytest.raises(ValueError, match="cannot get 2 blocks, only 1 free"):
        pool.get_new_blocks(2)
    # Nothing was taken by the failed call.
    pool.check_invariants()
    assert pool.num_free_blocks == 1 and pool.free_queue.block_ids() == [3]
    assert ids(pool.get_new_blocks(1)) == [3]
    pool.check_invariants()
    assert pool.usage() == 1.0


def test_get_new_blocks_clears_stale_hash() -> None:
    pool = BlockPool(2, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, b"h1234")
    pool.free_blocks([b])
    assert b.block_hash == b"h1234"  # a freed block keeps its content until reused
    assert pool.get_cached_block(b"h1234") is b
    pool.get_new_blocks(1)  # block 1
    (again,) = pool.get_new_blocks(1)
    assert again is b and again.block_hash is None
    assert pool.get_cached_block(b"h1234") is None
    pool.check_invariants()


def test_free_order_decides_reuse_order() -> None:
    pool = BlockPool(6)
    req = pool.get_new_blocks(3)  # 0, 1, 2
    pool.check_invariants()
    pool.free_blocks(reversed(req))  # tail first
    pool.check_invariants()
    assert pool.free_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    assert all(b.ref_cnt == 0 for b in req)
    # Never-used blocks come first, then the freed request's tail before its head.
    assert ids(pool.get_new_blocks(4)) == [3, 4, 5, 2]
    pool.check_invariants()
    assert ids(pool.get_new_blocks(2)) == [1, 0]
    pool.check_invariants()
    assert pool.num_free_blocks == 0


def test_free_in_given_order_head_first() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks([blocks[1], blocks[3], blocks[0]])
    pool.check_invariants()
    assert pool.free_queue.block_ids() == [1, 3, 0]
    assert ids(pool.get_new_blocks(3)) == [1, 3, 0]


def test_interleaved_free_of_two_requests() -> None:
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)  # 0, 1
    b = pool.get_new_blocks(3)  # 2, 3, 4
    pool.free_blocks(reversed(b))
    pool.check_invariants()
    assert pool.free_queue.block_ids() == [5, 4, 3, 2]
    pool.free_blocks(reversed(a))
    pool.check_invariants()
    assert pool.free_queue.block_ids() == [5, 4, 3, 2, 1, 0]


def test_shared_block_freed_only_when_last_reference_dropped() -> None:
    pool = BlockPool(4)
    (b0, b1) = pool.get_new_blocks(2)
    pool.touch([b0])  # a second request shares block 0
    pool.check_invariants()
    assert b0.ref_cnt == 2 and b1.ref_cnt == 1
    pool.free_blocks([b1, b0])
    pool.check_invariants()
    assert b0.ref_cnt == 1 and b1.ref_cnt == 0
    assert pool.free_queue.block_ids() == [2, 3, 1]
    assert pool.num_used_blocks == 1
    pool.free_blocks([b0])
    pool.check_invariants()
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]


def test_touch_free_block_removes_it_from_queue() -> None:
    pool = BlockPool(5)
    blk = pool.blocks[2]
    pool.touch([blk])
    pool.check_invariants()
    assert blk.ref_cnt == 1
    assert pool.free_queue.block_ids() == [0, 1, 3, 4]
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 1
    # The touched block is not handed out again.
    assert ids(pool.get_new_blocks(4)) == [0, 1, 3, 4]
    pool.check_invariants()
    pool.free_blocks([blk])
    pool.check_invariants()
    assert pool.free_queue.block_ids() == [2]


def test_touch_freed_block_keeps_hash_and_reclaims_it() -> None:
    pool = BlockPool(4, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, b"h99")
    pool.free_blocks([b])
    assert pool.free_queue.block_ids() == [1, 2, 3, 0]
    pool.touch([b])
    pool.check_invariants()
    assert b.ref_cnt == 1 and b.block_hash == b"h99"
    assert pool.free_queue.block_ids() == [1, 2, 3]


def test_touch_held_block_only_bumps_count() -> None:
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b, b])
    pool.check_invariants()
    assert b.ref_cnt == 3
    assert pool.free_queue.block_ids() == [1, 2]


def test_double_free_asserts() -> None:
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    pool.check_invariants()
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([b])
    pool.check_invariants()
    assert pool.free_queue.block_ids() == [1, 2, 0]


def test_free_never_allocated_block_asserts() -> None:
    pool = BlockPool(2)
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([pool.blocks[1]])
    pool.check_invariants()
    assert pool.free_queue.block_ids() == [0, 1]


def test_check_invariants_catches_corruption() -> None:
    pool = BlockPool(3)
    pool.blocks[1].ref_cnt = 1  # claims to be used but still sits in the free queue
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool = BlockPool(3)
    pool.free_queue.num_free_blocks += 1
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_long_mixed_sequence_keeps_invariants() -> None:
    pool = BlockPool(10)
    held: list[list[KVCacheBlock]] = []
    for step in range(60):
        if step % 3 != 2 and pool.num_free_blocks >= 2:
            held.append(pool.get_new_blocks(2))
        elif held:
            pool.free_blocks(reversed(held.pop(step % len(held))))
        pool.check_invariants()
        assert pool.num_free_blocks + pool.num_used_blocks == 10
        assert pool.num_used_blocks == sum(len(h) for h in held)
    for h in held:
        pool.free_blocks(reversed(h))
    pool.check_invariants()
    assert sorted(pool.free_queue.block_ids()) == list(range(10))
