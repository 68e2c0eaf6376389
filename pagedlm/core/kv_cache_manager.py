"""Per-request block tables on top of the block pool.

A request's block table is the list of blocks holding its tokens in order: token `i`
lives in `blocks[i // block_size]` at offset `i % block_size`. The table grows one
block at a time, only when a new token would not fit in the last block, and all of it
goes back to the pool the moment the request finishes, is aborted or is preempted.

Sharing. A block may sit in several tables at once (ref_cnt > 1):
  * prefix caching: a new request starts with the cached blocks of its longest cached
    prefix (full blocks only, never written again);
  * forking (n > 1 samples, beams): a child starts with all of its parent's blocks.
    The last block may be partly filled; whoever writes into it while it is shared
    first gets a private copy (copy-on-write). The copies to perform are queued in
    `pending_copies` for the model runner.

Sliding window. When every attention layer sees only the last W tokens (query position
i sees keys i - W < j <= i), a block whose last token j has j <= num_computed_tokens - W
is invisible to every future query of its request. `allocate_slots` returns such blocks
to the pool (they stay in the prefix cache, like any freed block) and puts the pool's
null block in their place, so token positions still index the table directly:

    W = 8, block_size 4, num_computed_tokens 16 (the next query, at 16, sees 9..16)
    table  [ null | null |  b7  |  b3   |  b9  ]    blocks 0-3 and 4-7 freed;
             0-3    4-7    8-11   12-15   16-19     8-11 stays (9..11 still visible)

Null entries always form a prefix of a table, and a request holds at most about
W / block_size + 2 real blocks at a decode step, however long it runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedlm.core.block_hash import extend_block_hashes
from pagedlm.core.block_pool import BlockPool, KVCacheBlock
from pagedlm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 sliding_window: int | None = None) -> None:
        """`sliding_window`: the window W shared by every attention layer of the model, or
        None (full attention, or layers with different windows: nothing is freed early).
        With a window, block 0 is reserved as the null block."""
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching,
                                    reserve_null_block=sliding_window is not None)
        self.null_block = self.block_pool.null_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src block id, dst block id)
        # Request id -> the first entry of its table changed since the workers last got it
        # (`take_block_ids_delta`); absent: nothing changed.
        self._changed_from: dict[str, int] = {}
        self.num_copies = 0

    @property
    def num_blocks(self) -> int:
        """Blocks requests can hold (the null block, if any, is not one of them)."""
        return self.block_pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def usage(self) -> float:
        return self.block_pool.usage()

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def max_blocks_held(self, num_tokens: int, max_num_new_tokens: int | None = None) -> int:
        """The most blocks a request growing to `num_tokens` tokens holds at once, when a
        step computes at most `max_num_new_tokens` of them (None: all at once).

        With a window W, a step computing k tokens after c computed ones holds the blocks
        from (c - W + 1) // block_size to (c + k - 1) // block_size, at most
        cdiv(k + W - 1, block_size) + 1 of them.
        """
        full = self.num_blocks_needed(num_tokens)
        if self.sliding_window is None:
            return full
        k = num_tokens if max_num_new_tokens is None else min(num_tokens, max_num_new_tokens)
        return min(full, cdiv(k + self.sliding_window - 1, self.block_size) + 1)

    def can_ever_fit(self, num_tokens: int, max_num_new_tokens: int | None = None) -> bool:
        """Whether a sequence of `num_tokens` fits in the whole cache with nothing else in it
        (see `max_blocks_held` for `max_num_new_tokens`)."""
        return self.max_blocks_held(num_tokens, max_num_new_tokens) <= self.num_blocks

    # ----- sliding window -----------------------------------------------------------------

    def _num_out_of_window(self, num_computed: int) -> int:
        """Leading blocks no query at a position >= num_computed can see: those whose last
        token j = (i + 1) * block_size - 1 satisfies j <= num_computed - W."""
        if self.sliding_window is None:
            return 0
        return max(0, (num_computed - self.sliding_window + 1) // self.block_size)

    def _free_out_of_window(self, blocks: list[KVCacheBlock], num_computed: int) -> int:
        # Null entries form a prefix, so walking back from the last invisible block to the
        # first null one touches only the newly invisible blocks. Tail first, as in `free`.
        # Returns the first entry that changed (len(blocks) or more: none).
        i = min(self._num_out_of_window(num_computed), len(blocks)) - 1
        freed = []
        while i >= 0 and blocks[i] is not self.null_block:
            freed.append(blocks[i])
            blocks[i] = self.null_block
            i -= 1
        if not freed:
            return len(blocks)
        self.block_pool.free_blocks(freed)
        return i + 1

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds a reference to (its table minus null entries)."""
        return len(self._held(self.req_to_blocks.get(request_id, ())))

    def _held(self, blocks: Sequence[KVCacheBlock]) -> list[KVCacheBlock]:
        """The real blocks of a table (its null entries hold no reference)."""
        if self.null_block is None:
            return list(blocks)
        return [b for b in blocks if b is not self.null_block]

    # ----- prefix caching -------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """The cached blocks of the request's longest cached prefix.

        At most `num_tokens - 1` tokens can be hits: the last token must be computed so
        that there are logits to sample from.
        """
        if not self.enable_caching or request.skip_prefix_cache:
            return []
        self._update_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def _update_hashes(self, request: Request, num_tokens: int | None = None) -> None:
        # Only tokens that are final may be hashed: a beam's last token can still change
        # before it is computed, so cached blocks hash computed tokens only.
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                            request.cache_extra_key, num_tokens)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full once its first `num_tokens` tokens
        are computed.

        The scheduler calls this when it schedules the step that computes them, so that
        requests admitted later in the same step already hit: every attention layer
        writes all of a step's K/V before any request reads the cache.
        """
        if not self.enable_caching:
            return
        num_full = num_tokens // self.block_size
        if num_full <= request.num_cached_blocks:
            return
        self._update_hashes(request, num_tokens)
        blocks = self.req_to_blocks[request.request_id]
        for i in range(request.num_cached_blocks, num_full):
            # A block is cached in the step that computes it, before the window can free
            # it; the check only guards that order.
            if blocks[i] is not self.null_block:
                self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        request.num_cached_blocks = num_full

    # ----- allocation ---------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = ()) -> bool:
        """Make room for `num_new_tokens` after the request's computed tokens (plus
        `new_computed_blocks`, prefix-cache hits that become its first blocks).

        All or nothing: returns False, changing nothing, when the pool is short (except that
        blocks the sliding window has left behind are released either way).
        With a window, hits no query can see any more take a null entry, not a reference.
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if (not new_computed_blocks and self.sliding_window is None
                and request.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size
                and not self._needs_copy(blocks, request.num_computed_tokens, num_new_tokens)):
            return True  # the room is there already (most decodes): nothing changes
        assert not new_computed_blocks or not blocks
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_invisible_hits = 0
        changed_from = len(blocks)
        if self.sliding_window is not None:
            changed_from = self._free_out_of_window(blocks, num_computed)
            num_invisible_hits = min(len(new_computed_blocks), self._num_out_of_window(num_computed))
        visible_hits = new_computed_blocks[num_invisible_hits:]
        num_needed = self.num_blocks_needed(num_computed + num_new_tokens)
        num_missing = max(0, num_needed - len(blocks) - len(new_computed_blocks))
        cow = self._needs_copy(blocks, num_computed, num_new_tokens)
        # Hits that sit free in the queue stop being available for new blocks.
        num_free_hits = sum(1 for b in visible_hits if b.ref_cnt == 0)
        if num_missing + cow > self.block_pool.num_free_blocks - num_free_hits:
            self._mark_changed(request.request_id, changed_from, len(blocks))
            return False
        if new_computed_blocks:
            self.block_pool.touch(visible_hits)
            blocks.extend([self.null_block] * num_invisible_hits)
            blocks.extend(visible_hits)
            request.num_cached_blocks = len(new_computed_blocks)
        if cow:
            changed_from = min(changed_from, num_computed // self.block_size)
            self._copy_last_block(blocks, num_computed // self.block_size)
        if num_missing:
            blocks.extend(self.block_pool.get_new_blocks(num_missing))
        self._mark_changed(request.request_id, changed_from, len(blocks))
        return True

    def _mark_changed(self, request_id: str, first: int, num_entries: int) -> None:
        if first < num_entries:
            self._changed_from[request_id] = min(self._changed_from.get(request_id, first), first)

    def _needs_copy(self, blocks: list[KVCacheBlock], num_computed: int, num_new: int) -> bool:
        """Writing into a partly filled block that another table also holds."""
        if num_new == 0 or num_computed % self.block_size == 0 or not blocks:
            return False
        last = blocks[num_computed // self.block_size]
        return last.ref_cnt > 1

    def _copy_last_block(self, blocks: list[KVCacheBlock], index: int) -> None:
        # Only the partly filled block at the end can be shared and written to.
        assert index == len(blocks) - 1, (index, len(blocks))
        shared = blocks[index]
        (private,) = self.block_pool.get_new_blocks(1)
        self.pending_copies.append((shared.block_id, private.block_id))
        self.num_copies += 1
        blocks[-1] = private
        self.block_pool.free_blocks([shared])

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (one more reference each)."""
        assert child.request_id not in self.req_to_blocks or not self.req_to_blocks[child.request_id]
        parent_blocks = self.req_to_blocks.get(parent.request_id, [])
        self.block_pool.touch(self._held(parent_blocks))
        self.req_to_blocks[child.request_id] = list(parent_blocks)
        child.num_cached_blocks = parent.num_cached_blocks
        child.block_hashes = parent.block_hashes[: parent.num_computed_tokens // self.block_size]

    def free_excess_blocks(self, request: Request) -> None:
        """Speculative decoding: give back the blocks past the request's tokens (slots the
        rejected drafts took, which hold nothing valid)."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = self.num_blocks_needed(request.num_tokens)
        if not blocks or len(blocks) <= keep:
            return
        excess = blocks[keep:]
        del blocks[keep:]
        changed = self._changed_from.get(request.request_id)
        if changed is not None and changed >= keep:
            del self._changed_from[request.request_id]  # nothing left to send from there
        self.block_pool.free_blocks(reversed(excess))

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, request: Request) -> None:
        request.num_cached_blocks = 0
        self._changed_from.pop(request.request_id, None)
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(self._held(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def take_block_ids(self, request_id: str) -> list[int]:
        """The whole table, for workers that do not hold the request yet."""
        self._changed_from.pop(request_id, None)
        return self.get_block_ids(request_id)

    def take_block_ids_delta(self, request_id: str) -> tuple[int, list[int]]:
        """(first changed entry, the table from there) since the last take, for workers
        that hold the rest of the table."""
        blocks = self.req_to_blocks.get(request_id, ())
        start = self._changed_from.pop(request_id, None)
        if start is None:  # unchanged (most steps)
            return len(blocks), []
        return start, [b.block_id for b in blocks[start:]]

    # ----- accounting ---------------------------------------------------------------------

    def num_allocated_slots(self) -> int:
        """Token slots in blocks referenced by requests (for the paging-waste report)."""
        return self.block_pool.num_used_blocks * self.block_size

    def num_shared_blocks(self) -> int:
        return self.block_pool.num_shared_blocks

    def num_distinct_tokens(self, requests: Sequence[Request]) -> int:
        """Token slots holding K/V, each shared slot counted once."""
        fill: dict[int, int] = {}
        bs = self.block_size
        for r in requests:
            for i, block in enumerate(self.req_to_blocks.get(r.request_id, ())):
                if block is self.null_block:
                    continue
                n = min(bs, max(0, r.num_computed_tokens - i * bs))
                if n > fill.get(block.block_id, 0):
                    fill[block.block_id] = n
        return sum(fill.values())

    def check_invariants(self, live_requests: list[Request] | None = None) -> None:
        """Ref counts equal the number of block tables holding each block; no leaks."""
        self.block_pool.check_invariants()
        assert set(self._changed_from) <= set(self.req_to_blocks), self._changed_from
        expected: dict[int, int] = {}
        if self.null_block is not None:
            expected[self.null_block.block_id] = 1  # the pool's own reference
        for blocks in self.req_to_blocks.values():
            held = self._held(blocks)
            # Null entries, if any, are a prefix of the table.
            assert all(b is self.null_block for b in blocks[: len(blocks) - len(held)]), blocks
            for block in held:
                expected[block.block_id] = expected.get(block.block_id, 0) + 1
        for block in self.block_pool.blocks:
            assert block.ref_cnt == expected.get(block.block_id, 0), (block, expected.get(block.block_id))
        if live_requests is not None:
            live = {r.request_id for r in live_requests}
            held = {rid for rid, blocks in self.req_to_blocks.items() if blocks}
            assert held <= live, f"blocks held by dead requests: {sorted(held - live)}"
            for r in live_requests:
                blocks = self.req_to_blocks.get(r.request_id, ())
                assert len(blocks) >= self.num_blocks_needed(r.num_computed_tokens), (r, len(blocks))
                # Only blocks no future query can see were replaced by the null block.
                num_null = len(blocks) - len(self._held(blocks))
                assert num_null <= self._num_out_of_window(r.num_computed_tokens), (r, num_null)
