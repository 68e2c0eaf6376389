"""Each KV block's state in one byte, for the live dashboard (engine/dashboard.py).

`block_states` derives every block's state from the pool's `ref_counts` and `hashed`
arrays with vector operations; `block_state_of` derives one block's from the block
object, the reference the pool's invariant check compares them with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pagedlm.core.block_pool import BlockPool

# The low three bits of a block's state byte; CACHED_FLAG marks a prefix-cache entry.
FREE = 0  # no reference, no cached content: the next to be handed out
EVICTABLE = 1  # no reference, but still a prefix-cache entry a request may claim back
OWNED = 2  # referenced by one sequence
SHARED = 3  # referenced by several (the ref count says how many)
COPYING = 4  # the destination of a copy-on-write in the last step
RESERVED = 5  # the null block of sliding-window models: never handed out
CACHED_FLAG = 8
STATE_NAMES = ("free", "evictable", "owned", "shared", "copying", "reserved")


def block_states(pool: BlockPool, copy_dsts: list[int]) -> np.ndarray:
    """Every block's state byte, from the pool's arrays (no Python loop over blocks)."""
    refs = pool.ref_counts
    states = np.where(refs == 0, np.where(pool.hashed, EVICTABLE, FREE),
                      np.where(refs == 1, OWNED, SHARED)).astype(np.uint8)
    if copy_dsts:
        dst = np.asarray(copy_dsts, dtype=np.int64)
        states[dst[refs[dst] > 0]] = COPYING
    if pool.null_block is not None:
        states[pool.null_block.block_id] = RESERVED
    states |= pool.hashed.astype(np.uint8) * CACHED_FLAG
    return states


def block_state_of(block, pool: BlockPool, copy_dsts: set[int]) -> int:
    """The same state for one block, from the block object: the reference that
    block_states is tested against."""
    if block is pool.null_block:
        state = RESERVED
    elif block.ref_cnt == 0:
        state = EVICTABLE if block.block_hash is not None else FREE
    elif block.block_id in copy_dsts:
        state = COPYING
    else:
        state = OWNED if block.ref_cnt == 1 else SHARED
    return state | (CACHED_FLAG if block.block_hash is not None else 0)


def state_counts(states: np.ndarray) -> dict[str, int]:
    counts = np.bincount(states & 7, minlength=len(STATE_NAMES))
    out = {name: int(counts[i]) for i, name in enumerate(STATE_NAMES)}
    out["prefix_cache_entries"] = int(np.count_nonzero(states & CACHED_FLAG))
    return out
