"""The C++ CPU prefill attention kernel (csrc/prefill_attention_cpu.cpp) against a dense
float64 reference over the same paged cache: query heads per kv head (1, 3, 4, 8), head
dims, cache dtypes, prefixes already in the cache (prefix caching, chunked prefill),
sliding windows, many sequences in one call, odd lengths around the kernel's query blocks
and key chunks; and bad inputs."""

import pytest
import torch

from pagedlm.attention.alibi import alibi_slopes
from pagedlm.attention.cpu_kernels import load_prefill_kernels, paged_prefill_attention
from pagedlm.attention.cpu_paged import CpuPagedAttention
from pagedlm.attention.reference import ReferenceAttention
from pagedlm.attention.testing import make_attention_case

pytestmark = pytest.mark.skipif(load_prefill_kernels() is None, reason="the kernel could not be built")


def dense_reference(q, k_cache, v_cache, block_tables, query_start, seq_lens, scale, window):
    """Each sequence's context gathered from its blocks, attention in float64."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for r, ctx in enumerate(seq_lens):
        start, end = query_start[r], query_start[r + 1]
        pos = torch.arange(ctx)
        slots = block_tables[r, pos // block_size] * block_size + pos % block_size
        k = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, 1)
        v = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, 1)
        qpos = torch.arange(ctx - (end - start), ctx)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].double(), k) * scale
        visible = pos[None, :] <= qpos[:, None]
        if window:
            visible &= qpos[:, None] - pos[None, :] < window
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def run_case(seqs, num_heads, num_kv_heads, head_dim, dtype=torch.float16, window=0, block_size=16, seed=0):
    """seqs: (new tokens, context length) per sequence."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max((ctx + block_size - 1) // block_size for _, ctx in seqs)
    num_blocks = len(seqs) * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    # Every sequence on its own scattered blocks.
    perm = torch.randperm(num_blocks, generator=g)[: len(seqs) * max_blocks]
    block_tables = perm.view(len(seqs), max_blocks).contiguous()
    query_start = [0]
    for q_len, _ in seqs:
        query_start.append(query_start[-1] + q_len)
    seq_lens = [ctx for _, ctx in seqs]
    q = torch.randn(query_start[-1], num_heads, head_dim, generator=g)
    scale = head_dim**-0.5
    out = paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start, seq_lens, scale, window)
    ref = dense_reference(q, k_cache, v_cache, block_tables, query_start, seq_lens, scale, window)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (8, 2), (16, 2)])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
def test_heads_and_dims(num_heads, num_kv_heads, head_dim):
    run_case([(37, 37), (5, 5), (130, 130)], num_heads, num_kv_heads, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16,
                                   torch.float8_e4m3fn, torch.float8_e5m2])
def test_cache_dtypes(dtype):
    run_case([(70, 70), (1, 1), (17, 40)], 9, 3, 64, dtype=dtype)


def test_prefixes_in_cache_and_chunks():
    """New tokens after a cached prefix (prefix caching, a later chunk of a chunked prefill),
    across block, query-block and key-chunk edges (128 keys per chunk)."""
    run_case([(16, 144), (1, 129), (100, 356), (48, 48), (49, 300), (3, 128)], 9, 3, 64)


@pytest.mark.parametrize("window", [1, 5, 64, 200])
def test_sliding_window(window):
    run_case([(150, 150), (30, 300), (7, 7)], 8, 2, 64, window=window)


def test_many_sequences_one_call():
    g = torch.Generator().manual_seed(1)
    seqs = []
    for _ in range(40):
        ctx = int(torch.randint(1, 400, (1,), generator=g))
        seqs.append((int(torch.randint(1, ctx + 1, (1,), generator=g)), ctx))
    run_case(seqs, 9, 3, 64, seed=1)


def test_thread_counts_give_identical_results():
    g = torch.Generator().manual_seed(2)
    k = torch.randn(40, 16, 3, 64, generator=g).half()
    v = torch.randn(40, 16, 3, 64, generator=g).half()
    q = torch.randn(300, 9, 64, generator=g)
    tables = torch.arange(40).view(2, 20)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(paged_prefill_attention(q, k, v, tables, [0, 250, 300], [250, 310], 0.125, 0))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


# (num_computed, num_new): decodes first, then fresh prompts and chunks after a cached prefix.
MIXED = [(0, 1), (20, 1), (47, 1), (0, 37), (16, 16), (33, 70), (5, 1 + 128), (0, 3)]


@pytest.mark.parametrize("options", [{}, {"sliding_window": 21}, {"alibi": True},
                                     {"logits_soft_cap": 2.0}], ids=str)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_backend_mixed_step_matches_reference(options, cache_dtype):
    """The CPU backend's forward on a step of decodes and prefills: the prefill rows go to
    the kernel (sliced after the decodes) or, with ALiBi / soft-capping, to torch; either
    way they match the reference backend."""
    case = make_attention_case(MIXED, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                               cache_dtype=cache_dtype, seed=3, sliding_window=options.get("sliding_window"))
    extra = {k: v for k, v in options.items() if k != "alibi"}
    if options.get("alibi"):
        extra["alibi_slopes"] = alibi_slopes(9)
    args = (case.query, case.key, case.value)
    k_ref, v_ref = case.clone_caches()
    k_cpu, v_cpu = case.clone_caches()
    ref = ReferenceAttention().forward(*args, k_ref, v_ref, case.meta, case.scale, **extra)
    out = CpuPagedAttention().forward(*args, k_cpu, v_cpu, case.meta, case.scale, **extra)
    tol = 1e-5 if cache_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_bad_inputs_raise_clear_errors():
    k = torch.zeros(4, 16, 2, 64, dtype=torch.float16)
    tables = torch.zeros(1, 4, dtype=torch.int64)
    q = torch.zeros(10, 4, 64)
    with pytest.raises(RuntimeError, match="do not fit its block table"):
        paged_prefill_attention(q, k, k, tables, [0, 10], [65], 1.0, 0)
    with pytest.raises(RuntimeError, match="query_start"):
        paged_prefill_attention(q, k, k, tables, [0, 9], [10], 1.0, 0)
    with pytest.raises(RuntimeError, match="not a multiple of num_kv_heads"):
        paged_prefill_attention(torch.zeros(10, 3, 64), k, k, tables, [0, 10], [10], 1.0, 0)
    with pytest.raises(RuntimeError, match="head_dim"):
        paged_prefill_attention(torch.zeros(10, 4, 32), k, k, tables, [0, 10], [10], 1.0, 0)
