"""Build consistent random attention inputs for tests and benchmarks.

`make_attention_case([(num_computed, num_new), ...], ...)` lays out one engine
step: request r already has `num_computed` tokens in the cache (its prefix) and
schedules `num_new` tokens now. Blocks are handed out from a shuffled pool so
block tables are not contiguous, and every cache slot that does not hold a
prefix token is filled with `fill` (NaN by default), so a backend that reads a
slot it should not read, or forgets a mask, shows up as NaN or a mismatch.

With `sliding_window=W` the case looks like the KV cache manager left it: the
leading blocks no query can see (last position <= num_computed - W) are replaced
in the block table by a null block that holds only `fill`.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedlm.attention.metadata import AttentionMetadata


@dataclass
class AttentionCase:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata
    scale: float

    def clone_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache.clone(), self.v_cache.clone()


def make_attention_case(
    seqs: Sequence[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    num_decodes: int | None = None,
    extra_blocks: int = 3,
    extra_table_cols: int = 1,
    fill: float = float("nan"),
    sliding_window: int | None = None,
) -> AttentionCase:
    """Random inputs for one step with requests `seqs = [(num_computed, num_new), ...]`.

    Requests keep the given order; the first `num_decodes` are the decodes (they
    must have num_new == 1). By default that is the leading run of num_new == 1.
    `extra_table_cols` pads every block-table row with that many more 0 columns.
    """
    if not seqs:
        raise ValueError("need at least one request")
    for computed, new in seqs:
        if computed < 0 or new < 1:
            raise ValueError(f"bad request (num_computed={computed}, num_new={new})")
    if num_decodes is None:
        num_decodes = 0
        while num_decodes < len(seqs) and seqs[num_decodes][1] == 1:
            num_decodes += 1
    if any(new != 1 for _, new in seqs[:num_decodes]):
        raise ValueError("decodes must have exactly one new token")
    cache_dtype = cache_dtype or dtype
    gen = torch.Generator().manual_seed(seed)

    seq_lens = [c + n for c, n in seqs]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]  # ceil division
    num_blocks = sum(blocks_per_seq) + extra_blocks + (sliding_window is not None)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    null_block = pool.pop() if sliding_window is not None else None
    max_blocks = max(blocks_per_seq) + extra_table_cols
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int64)
    tables: list[list[int]] = []
    num_freed = []  # leading blocks of each request replaced by the null block
    for r, nb in enumerate(blocks_per_seq):
        ids, pool = pool[:nb], pool[nb:]
        tables.append(ids)
        block_tables[r, :nb] = torch.tensor(ids, dtype=torch.int64)
        freed = 0
        if sliding_window is not None:
            freed = max(0, (seqs[r][0] - sliding_window + 1) // block_size)
            block_tables[r, :freed] = null_block
        num_freed.append(freed)

    def slot(r: int, pos: int) -> int:
        return tables[r][pos // block_size] * block_size + pos % block_size

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, fill, dtype=cache_dtype)
    v_cache = torch.full(shape, fill, dtype=cache_dtype)
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    prefix_slots: list[int] = []  # written by earlier steps
    slot_mapping: list[int] = []  # written by this step
    query_start_loc = [0]
    for r, (computed, new) in enumerate(seqs):
        prefix_slots.extend(slot(r, pos) for pos in range(num_freed[r] * block_size, computed))
        slot_mapping.extend(slot(r, pos) for pos in range(computed, computed + new))
        query_start_loc.append(query_start_loc[-1] + new)
    prefix = torch.tensor(prefix_slots, dtype=torch.int64)
    prefix_shape = (len(prefix_slots), num_kv_heads, head_dim)
    k_flat[prefix] = torch.randn(prefix_shape, generator=gen).to(cache_dtype)
    v_flat[prefix] = torch.randn(prefix_shape, generator=gen).to(cache_dtype)

    num_tokens = query_start_loc[-1]
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)

    meta = AttentionMetadata(
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        num_prefills=len(seqs) - num_decodes,
        num_tokens=num_tokens,
        max_query_len=max(n for _, n in seqs),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    return AttentionCase(
        query=query.to(device),
        key=key.to(device),
        value=value.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        meta=meta,
        scale=head_dim**-0.5,
    )
