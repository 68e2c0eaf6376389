"""The C++ CPU paged decode kernel against a dense, obviously correct computation."""

import math

import pytest
import torch

from pagedlm.attention.cpu_kernels import load_cpu_kernels, paged_decode_attention

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="CPU kernels could not be built")


def dense_decode(query, k_cache, v_cache, block_tables, seq_lens, scale, slopes=None,
                 window=None, cap=None):
    block_size = k_cache.shape[1]
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    outs = []
    for b, n in enumerate(seq_lens):
        t = torch.arange(n)
        slots = block_tables[b, t // block_size] * block_size + t % block_size
        k = k_cache.reshape(-1, num_kv_heads, k_cache.shape[-1])[slots].float()  # [n, kvh, d]
        v = v_cache.reshape(-1, num_kv_heads, v_cache.shape[-1])[slots].float()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [h, n, d]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        s = (k @ query[b].float()[:, :, None])[..., 0] * scale  # [h, n]
        if cap:
            s = cap * torch.tanh(s / cap)
        if slopes is not None:
            s = s + slopes[:, None] * (t - (n - 1))[None].float()
        if window:
            s = s.masked_fill((n - 1 - t >= window)[None], -math.inf)
        outs.append((s.softmax(-1)[:, None, :] @ v)[:, 0])  # [h, d]
    return torch.stack(outs)


# Group sizes 1, 3 and 8 cover every query-head tile of the register-tiled path (3 heads
# at a time: 8 = 3 + 3 + 2); head_dim 32/64/80/40 cover its value tiles (32 dims at a
# time, then a 16- or 8-dim remainder); head_dim 20 takes the untiled path.
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [
    (4, 4, 32), (6, 2, 64), (8, 1, 32), (9, 3, 80), (4, 2, 40), (3, 1, 20)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16,
                                         torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("features", ["plain", "window", "softcap", "alibi", "all"])
def test_paged_decode_matches_dense(num_heads, num_kv_heads, head_dim, cache_dtype, features):
    g = torch.Generator().manual_seed(num_heads * 7 + num_kv_heads + head_dim)
    block_size, num_blocks = 8, 200
    # Lengths around block and partition (256) boundaries, one long enough for 3 partitions.
    seq_lens = [1, 7, 8, 9, 255, 256, 257, 700]
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(cache_dtype)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    # Every sequence gets its own scattered blocks; the table's padding points at block 0.
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.long)
    used = 0
    for b, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        block_tables[b, :nb] = perm[used % num_blocks : used % num_blocks + nb] if used + nb <= num_blocks \
            else torch.randint(0, num_blocks, (nb,), generator=g)
        used += nb
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=g)
    kw = {}
    if features in ("window", "all"):
        kw["sliding_window"] = 100
    if features in ("softcap", "all"):
        kw["logits_soft_cap"] = 5.0
    if features in ("alibi", "all"):
        kw["alibi_slopes"] = torch.rand(num_heads, generator=g) * 0.2
    scale = head_dim**-0.5
    out = paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, **kw)
    ref = dense_decode(query, k_cache, v_cache, block_tables, seq_lens, scale,
                       slopes=kw.get("alibi_slopes"), window=kw.get("sliding_window"),
                       cap=kw.get("logits_soft_cap"))
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("head_dim", [32, 64, 20])
def test_every_float8_code_reads_back_exactly(cache_dtype, head_dim):
    """With one key, attention returns its value row: every finite float8 code (subnormals
    and signed zero included) must widen to exactly what torch makes of it."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(cache_dtype).float()
    codes[~torch.isfinite(values)] = 0  # NaN (and e5m2's inf) are never stored
    rows = -(-256 // head_dim)
    v = torch.zeros(rows * head_dim, dtype=torch.uint8)
    v[:256] = codes
    v_cache = v.view(cache_dtype).view(rows, 1, 1, head_dim)  # one token per block
    k_cache = torch.ones(rows, 1, 1, head_dim).to(cache_dtype)
    block_tables = torch.arange(rows).view(rows, 1)
    query = torch.randn(rows, 2, head_dim)
    out = paged_decode_attention(query, k_cache, v_cache, block_tables, [1] * rows, 0.5)
    want = v_cache.float()[:, 0, 0]  # [rows, head_dim]
    assert torch.equal(out[:, 0], want) and torch.equal(out[:, 1], want)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("seq_lens", [[300], [40, 33], [5, 1000], [2000]])
def test_small_batches_split_their_kv_heads(threads, seq_lens):
    """Too few 256-token partitions for the threads: the kernel splits each partition's kv
    heads over several items (each writing its heads' part of the partition's results)."""
    g = torch.Generator().manual_seed(sum(seq_lens) + threads)
    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 1
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).half()
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).half()
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.long)
    for b, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        block_tables[b, :nb] = torch.tensor(perm[:nb])
        perm = perm[nb:]
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 0.125)
    finally:
        torch.set_num_threads(before)
    ref = dense_decode(query, k_cache, v_cache, block_tables, seq_lens, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [
    (9, 3, 64), (8, 8, 32), (8, 1, 32), (4, 2, 40), (3, 1, 20)])
def test_a_rows_result_does_not_depend_on_its_batch(threads, num_heads, num_kv_heads, head_dim):
    """Each sequence's output is bit for bit the same alone and beside any others: its
    partitions (the order of its float sums) follow from its own length, never from the
    batch's. Speculative verification relies on it (k + 1 rows must give what decoding one
    at a time gives). Lengths below, at and above every partition size."""
    g = torch.Generator().manual_seed(11 + threads + head_dim)
    block_size = 16
    seq_lens = [1, 31, 33, 64, 100, 129, 255, 300, 513, 1030]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 1
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).half()
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).half()
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.long)
    first = 1
    for b, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        block_tables[b, :nb] = torch.arange(first, first + nb)
        first += nb
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batched = paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 0.125)
        for b, n in enumerate(seq_lens):
            alone = paged_decode_attention(query[b:b + 1], k_cache, v_cache,
                                           block_tables[b:b + 1], [n], 0.125)
            assert torch.equal(alone[0], batched[b]), f"sequence of {n} tokens"
        # The same rows in another order, and each beside a copy of itself.
        order = list(reversed(range(len(seq_lens))))
        shuffled = paged_decode_attention(query[order], k_cache, v_cache, block_tables[order],
                                          [seq_lens[i] for i in order], 0.125)
        assert torch.equal(shuffled, batched[order])
        twice = paged_decode_attention(query.repeat(2, 1, 1), k_cache, v_cache,
                                       block_tables.repeat(2, 1), seq_lens * 2, 0.125)
        assert torch.equal(twice[:len(seq_lens)], batched)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [
    (9, 3, 64), (8, 2, 32), (8, 1, 128), (4, 2, 40), (6, 3, 80), (3, 1, 20)])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                                         torch.float32])
@pytest.mark.parametrize("features", ["plain", "window", "softcap+alibi"])
def test_verification_rows_equal_rows_alone(threads, num_heads, num_kv_heads, head_dim,
                                            cache_dtype, features):
    """A speculative verification's k + 1 rows (one sequence's blocks, consecutive
    lengths, longest first as the model runner orders them, or last) are computed
    together, the cache read once for all of them: each row's output is still, bit for
    bit, the one it gets alone. Runs of 1 to 17 rows (over the kernel's 16 per run),
    ending before, at and past partition edges (256, 512), beside plain rows; the same
    rows in the opposite order give the same outputs."""
    g = torch.Generator().manual_seed(7 * threads + head_dim + num_kv_heads)
    block_size = 16
    # (longest length, rows, longest first)
    runs = [(5, 1, True), (40, 7, True), (258, 7, False), (256, 3, True), (515, 17, True),
            (300, 1, False), (1030, 4, False), (600, 2, True)]
    seq_lens, owner = [], []
    for s_i, (end, rows, longest_first) in enumerate(runs):
        lens = [end - rows + 1 + r for r in range(rows)]
        seq_lens += lens[::-1] if longest_first else lens
        owner += [s_i] * rows
    num_blocks = sum(-(-end // block_size) for end, _, _ in runs) + 1
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(cache_dtype)
    max_blocks = max(-(-end // block_size) for end, _, _ in runs)
    tables = torch.zeros(len(runs), max_blocks, dtype=torch.long)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    for s_i, (end, _, _) in enumerate(runs):
        nb = -(-end // block_size)
        tables[s_i, :nb] = torch.tensor(perm[:nb])
        perm = perm[nb:]
    block_tables = tables[owner]
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=g)
    kw = {}
    if features == "window":
        kw["sliding_window"] = 300
    if features == "softcap+alibi":
        kw["logits_soft_cap"] = 5.0
        kw["alibi_slopes"] = torch.rand(num_heads, generator=g) * 0.2
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batched = paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 0.125, **kw)
        for b, n in enumerate(seq_lens):
            alone = paged_decode_attention(query[b:b + 1], k_cache, v_cache,
                                           block_tables[b:b + 1], [n], 0.125, **kw)
            assert torch.equal(alone[0], batched[b]), f"row {b} ({n} tokens)"
        order = list(reversed(range(len(seq_lens))))
        reversed_out = paged_decode_attention(query[order], k_cache, v_cache, block_tables[order],
                                              [seq_lens[i] for i in order], 0.125, **kw)
        assert torch.equal(reversed_out, batched[order])
    finally:
        torch.set_num_threads(before)
    ref = dense_decode(query, k_cache, v_cache, block_tables, seq_lens, 0.125,
                       slopes=kw.get("alibi_slopes"), window=kw.get("sliding_window"),
                       cap=kw.get("logits_soft_cap"))
    torch.testing.assert_close(batched, ref, atol=2e-5, rtol=2e-5)


def test_rejects_bad_input():
    k = torch.zeros(4, 8, 2, 16)
    q = torch.zeros(1, 4, 16)
    bt = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="outside the block table"):
        paged_decode_attention(q, k, k, bt, [17], 1.0)
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        paged_decode_attention(torch.zeros(1, 3, 16), k, k, bt, [3], 1.0)
