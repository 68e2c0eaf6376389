"""Per-request block tables on top of the block pool.

A request's block table is the list of blocks holding its tokens in order: token `i`
lives in `blocks[i // block_size]` at offset `i % block_size`. The table grows one
block at a time, only when a new token would not fit in the last block, and all of it
goes back to the pool the moment the request finishes, is aborted or is preempted.
"""

from __future__ import annotations

from pagedlm.core.block_pool import BlockPool, KVCacheBlock
from pagedlm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.block_pool.num_blocks * self.block_size

    def usage(self) -> float:
        return self.block_pool.usage()

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` fits in the whole cache with nothing else in it."""
        return self.num_blocks_needed(num_tokens) <= self.block_pool.num_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` after the request's computed tokens.

        All or nothing: returns False, allocating nothing, when the pool is short.
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_needed = self.num_blocks_needed(request.num_computed_tokens + num_new_tokens)
        num_missing = num_needed - len(blocks)
        if num_missing <= 0:
            return True
        if num_missing > self.block_pool.num_free_blocks:
            return False
        blocks.extend(self.block_pool.get_new_blocks(num_missing))
        return True

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def num_allocated_slots(self) -> int:
        """Token slots in blocks referenced by requests (for the paging-waste report)."""
        return self.block_pool.num_used_blocks * self.block_size

    def check_invariants(self, live_requests: list[Request] | None = None) -> None:
        """Ref counts equal the number of block tables holding each block; no leaks."""
        self.block_pool.check_invariants()
        expected: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for block in blocks:
                expected[block.block_id] = expected.get(block.block_id, 0) + 1
        for block in self.block_pool.blocks:
            assert block.ref_cnt == expected.get(block.block_id, 0), (block, expected.get(block.block_id))
        if live_requests is not None:
            live = {r.request_id for r in live_requests}
            held = {rid for rid, blocks in self.req_to_blocks.items() if blocks}
            assert held <= live, f"blocks held by dead requests: {sorted(held - live)}"
            for r in live_requests:
                n = len(self.req_to_blocks.get(r.request_id, ()))
                assert n >= self.num_blocks_needed(r.num_computed_tokens), (r, n)
