"""The pool that owns every KV cache block.

A block is a fixed number (`block_size`) of token slots in every layer's K/V cache.
The pool hands blocks out, counts references to them and takes them back:

    ref_cnt == 0  <=>  the block is in the free queue

The free queue is a doubly linked list threaded through the blocks themselves, so a
block can be taken from the front, put at the back, or removed from the middle in O(1).
Removal from the middle is what prefix caching needs: a freed block keeps its content
and can be claimed again by a later request until it reaches the front and is reused.

With `reserve_null_block` (sliding-window models), block 0 is the null block: it stands
in a block table for a block freed because no future query can see it, and attention
never reads it (the window masks it). It is never handed out, hashed or freed, and its
ref_cnt stays pinned at 1 (held by the pool, not by the tables that name it).

Two numpy arrays mirror, block by block, what the dashboard draws: `ref_counts` (each
block's ref_cnt) and `hashed` (the block is a prefix-cache entry). They are kept as the
counts change, so a snapshot of every block's state is a few vector operations
(engine/dashboard.py), never a walk over the blocks in Python.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from pagedlm.core.block_states import block_state_of, block_states


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Content hash of a full block (set by prefix caching); None while not cached.
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; the front is the next to be reused."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        # Sentinels make every operation branch-free at the ends.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, block
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, block
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]


class BlockPool:
    """Every block of the cache, its reference count, the free queue and the prefix cache.

    With caching on, a full block that has been computed is registered under its content
    hash. It stays registered when freed, so a later request with the same prefix can
    claim it back from the free queue; it is forgotten only when the queue hands it out
    for new content (eviction, least recently freed first).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = False,
                 reserve_null_block: bool = False) -> None:
        if num_blocks < 1 + reserve_null_block:
            raise ValueError(f"num_blocks must be at least {1 + reserve_null_block}, got {num_blocks}")
        self.num_blocks = num_blocks  # including the null block
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0
        self.num_shared_blocks = 0  # blocks with ref_cnt > 1, kept as refs change
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)  # == [b.ref_cnt for b in blocks]
        self.hashed = np.zeros(num_blocks, dtype=np.bool_)  # == [b.block_hash is not None ...]
        self.null_block: KVCacheBlock | None = None
        if reserve_null_block:
            self.null_block = self.free_queue.popleft()
            self.null_block.ref_cnt = 1
            self.ref_counts[self.null_block.block_id] = 1

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all but the null block."""
        return self.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.free_queue.num_free_blocks

    def usage(self) -> float:
        """Fraction of usable blocks referenced by at least one request (0-1)."""
        return self.num_used_blocks / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the front of the free queue, each with ref_cnt 1."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks, only {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            assert block.ref_cnt == 0
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            self.ref_counts[block.block_id] = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
            self.num_evictions += 1
        block.block_hash = None
        self.hashed[block.block_id] = False

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a computed full block. A block whose content is already cached under
        another block (two requests computed the same prefix at once) stays unregistered."""
        assert block.ref_cnt > 0 and block is not self.null_block
        if block.block_hash is not None or block_hash in self.cached_blocks:
            return
        block.block_hash = block_hash
        self.hashed[block.block_id] = True
        self.cached_blocks[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        self.hashed[:] = False

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to blocks another request already holds (or that sit free)."""
        for block in blocks:
            assert block is not self.null_block
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            elif block.ref_cnt == 1:
                self.num_shared_blocks += 1
            block.ref_cnt += 1
            self.ref_counts[block.block_id] += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the order given.

        A block whose count reaches zero goes to the back of the free queue, so callers
        pass a request's blocks tail first: its tail is then reused before its head.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            assert block is not self.null_block
            block.ref_cnt -= 1
            self.ref_counts[block.block_id] -= 1
            if block.ref_cnt == 1:
                self.num_shared_blocks -= 1
            elif block.ref_cnt == 0:
                self.free_queue.append(block)

    def check_invariants(self) -> None:
        """Free queue == blocks with no reference; counts consistent (tests, debugging)."""
        free_ids = self.free_queue.block_ids()
        assert len(free_ids) == len(set(free_ids)) == self.num_free_blocks
        zero_ref = {b.block_id for b in self.blocks if b.ref_cnt == 0}
        assert set(free_ids) == zero_ref, (sorted(free_ids), sorted(zero_ref))
        assert all(b.ref_cnt >= 0 for b in self.blocks)
        assert self.num_shared_blocks == sum(1 for b in self.blocks if b.ref_cnt > 1)
        assert self.ref_counts.tolist() == [b.ref_cnt for b in self.blocks]
        assert self.hashed.tolist() == [b.block_hash is not None for b in self.blocks]
        assert block_states(self, []).tolist() == [block_state_of(b, self, set())
                                                   for b in self.blocks]
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, (block, block_hash)
        hashed = {b.block_id for b in self.blocks if b.block_hash is not None}
        assert hashed == {b.block_id for b in self.cached_blocks.values()}
        if self.null_block is not None:
            null = self.null_block
            assert null.ref_cnt == 1 and null.block_hash is None and null.prev_free is None, null
