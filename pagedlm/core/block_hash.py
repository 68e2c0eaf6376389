"""Content hashes of full KV blocks, chained so a hash names a whole prefix.

    hash(block i) = SHA-256(hash(block i-1) || extra key || token ids of block i)

Two blocks with the same hash hold the same tokens after the same prefix, hence the
same K/V, so a new request can reuse them. SHA-256, not Python's 64-bit `hash()`:
prefix-cache entries are shared between users, and a crafted collision on a weak hash
would let one user's prompt read K/V computed for another's. With SHA-256 a collision
is not a practical concern, so hits are not re-verified token by token.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = hashlib.sha256(b"pagedlm-prefix-cache-v1").digest()


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    h = hashlib.sha256(parent if parent is not None else ROOT_HASH)
    # Length-prefix the extra key so (extra, tokens) pairs cannot run into each other.
    h.update(len(extra_key).to_bytes(4, "little"))
    h.update(extra_key)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        extra_key: bytes = b"", num_tokens: int | None = None) -> None:
    """Append the hashes of every full block of `token_ids[:num_tokens]` not hashed yet."""
    num_full = (len(token_ids) if num_tokens is None else num_tokens) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        # Only the first block carries the extra key; the chain carries it onward.
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size],
                                 extra_key if i == 0 else b""))
