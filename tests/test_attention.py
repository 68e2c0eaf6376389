"""The fast paged attention backend must match the loop-based reference exactly
(up to float rounding), on many batch layouts, and write the cache exactly where
slot_mapping says and nowhere else."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedlm.attention.alibi import alibi_slopes
from pagedlm.attention.backends import get_attention_backend
from pagedlm.attention.reference import ReferenceAttention
from pagedlm.attention.testing import AttentionCase, make_attention_case
from pagedlm.attention.torch_paged import TorchPagedAttention, write_kv_cache

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}

# (num_heads, num_kv_heads): MHA, GQA 3 (SmolLM2), GQA 4, MQA.
HEADS = [(4, 4), (9, 3), (8, 2), (8, 1)]


@pytest.fixture(autouse=True)
def one_thread():
    """The reference runs thousands of tiny ops; on a shared 2-core box, intra-op
    threads only add wake-up latency to them (10x slower measured)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def mixed_layout(bs: int) -> list[tuple[int, int]]:
    """(num_computed, num_new) per request: decodes first, then prefills and chunks.

    Context lengths hit 1, exact multiples of the block size and their neighbours.
    """
    decodes = [(0, 1), (bs - 1, 1), (bs, 1), (3 * bs - 1, 1), (2 * bs + 5, 1)]
    prefills = [
        (0, bs),  # fresh prompt, exactly one block
        (0, 7),  # fresh prompt, partial block
        (bs, bs),  # chunk continuing at a block boundary
        (5, 2 * bs + 3),  # chunk starting mid-block, spanning blocks
        (2 * bs - 1, 1),  # one-token chunk in the prefill section
        (0, 1),  # one-token prompt
    ]
    return decodes + prefills


def expected_caches(case: AttentionCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches after the write, built slot by slot in the obvious way."""
    k_cache, v_cache = case.clone_caches()
    bs = k_cache.shape[1]
    for t, slot in enumerate(case.meta.slot_mapping.tolist()):
        k_cache[slot // bs, slot % bs] = case.key[t]
        v_cache[slot // bs, slot % bs] = case.value[t]
    return k_cache, v_cache


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def check_case(case: AttentionCase, tag: str = "", slopes: torch.Tensor | None = None,
               **options: object) -> float:
    """Run both backends on copies of the cache; compare outputs and the caches.
    `options`: sliding_window / logits_soft_cap, passed to both backends."""
    k_ref, v_ref = case.clone_caches()
    k_fast, v_fast = case.clone_caches()
    args = (case.query, case.key, case.value)
    extra = dict(options) if slopes is None else {"alibi_slopes": slopes, **options}
    ref = ReferenceAttention().forward(*args, k_ref, v_ref, case.meta, case.scale, **extra)
    fast = TorchPagedAttention().forward(*args, k_fast, v_fast, case.meta, case.scale, **extra)

    assert fast.shape == case.query.shape and fast.dtype == case.query.dtype
    assert torch.isfinite(ref).all() and torch.isfinite(fast).all()
    diff = (fast.float() - ref.float()).abs().max().item()
    print(f"{tag} {case.query.dtype} max abs diff {diff:.3e}")
    torch.testing.assert_close(fast, ref, **TOL[case.query.dtype])

    k_exp, v_exp = expected_caches(case)
    for got in (k_ref, k_fast):
        assert_same_bits(got, k_exp)
    for got in (v_ref, v_fast):
        assert_same_bits(got, v_exp)
    return diff


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch_fp32(head_dim: int, block_size: int, heads: tuple[int, int]) -> None:
    num_heads, num_kv_heads = heads
    case = make_attention_case(
        mixed_layout(block_size),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        seed=head_dim + block_size + num_heads * 10 + num_kv_heads,
    )
    assert case.meta.num_decodes == 5 and case.meta.num_prefills == 6
    assert check_case(case, f"d{head_dim} bs{block_size} {heads}") < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1)], ids=["gqa3", "mqa"])
def test_mixed_batch_low_precision(dtype: torch.dtype, heads: tuple[int, int]) -> None:
    case = make_attention_case(
        mixed_layout(16),
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=64,
        block_size=16,
        dtype=dtype,
        seed=7,
    )
    check_case(case, f"{heads}")


@pytest.mark.parametrize(
    "layout",
    [
        [(40, 1)],  # a single decode
        [(c, 1) for c in (0, 3, 15, 16, 31, 47, 100)],  # decodes only
        [(0, 33)],  # a single fresh prompt
        [(0, 16), (0, 5), (0, 48)],  # prompts only
        [(32, 16), (17, 20), (3, 1)],  # chunks with a cached prefix only
    ],
    ids=["one_decode", "decodes", "one_prompt", "prompts", "chunks"],
)
def test_uniform_batches(layout: list[tuple[int, int]]) -> None:
    case = make_attention_case(layout, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    check_case(case)


def test_cache_in_other_dtype() -> None:
    """A bf16 cache under fp32 activations: both backends read back the rounded K/V."""
    case = make_attention_case(
        mixed_layout(8),
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=8,
        cache_dtype=torch.bfloat16,
    )
    check_case(case)


def test_strided_inputs_from_fused_qkv() -> None:
    """q/k/v sliced out of one fused projection output are strided, not contiguous."""
    case = make_attention_case(
        mixed_layout(8), num_heads=9, num_kv_heads=3, head_dim=64, block_size=8
    )
    t = case.query.shape[0]
    qkv = torch.cat([case.query.flatten(1), case.key.flatten(1), case.value.flatten(1)], dim=1)
    case.query = qkv[:, : 9 * 64].view(t, 9, 64)  # [t, 9, 64], row stride 15 * 64
    case.key = qkv[:, 9 * 64 : 12 * 64].view(t, 3, 64)  # [t, 3, 64]
    case.value = qkv[:, 12 * 64 :].view(t, 3, 64)  # [t, 3, 64]
    assert not case.query.is_contiguous()
    check_case(case)


def test_write_kv_cache_touches_only_its_slots() -> None:
    case = make_attention_case(
        mixed_layout(16), num_heads=9, num_kv_heads=3, head_dim=64, block_size=16
    )
    k_cache, v_cache = case.clone_caches()
    write_kv_cache(case.key, case.value, k_cache, v_cache, case.meta.slot_mapping)
    k_exp, v_exp = expected_caches(case)
    assert_same_bits(k_cache, k_exp)
    assert_same_bits(v_cache, v_exp)
    # And the written slots really hold the new tokens (not NaN fill).
    slots = case.meta.slot_mapping
    assert torch.equal(k_cache.view(-1, 3, 64)[slots], case.key)
    assert torch.equal(v_cache.view(-1, 3, 64)[slots], case.value)


def test_reference_single_token_returns_its_value() -> None:
    """Sanity check of the oracle itself: attending to one token returns its value."""
    case = make_attention_case(
        [(0, 1), (0, 1)], num_heads=6, num_kv_heads=2, head_dim=64, block_size=8
    )
    k_cache, v_cache = case.clone_caches()
    out = ReferenceAttention().forward(
        case.query, case.key, case.value, k_cache, v_cache, case.meta, case.scale
    )
    expected = case.value.repeat_interleave(3, dim=1)  # query head h uses kv head h // 3
    torch.testing.assert_close(out, expected)


def test_reference_matches_dense_causal_attention() -> None:
    """Sanity check of the oracle: a fresh prompt equals plain dense causal attention."""
    case = make_attention_case([(0, 21)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
    k_cache, v_cache = case.clone_caches()
    out = ReferenceAttention().forward(
        case.query, case.key, case.value, k_cache, v_cache, case.meta, case.scale
    )
    k = case.key.repeat_interleave(2, dim=1)  # [21, 4, 64]
    v = case.value.repeat_interleave(2, dim=1)  # [21, 4, 64]
    scores = torch.einsum("qhd,khd->hqk", case.query, k) * case.scale  # [4, 21, 21]
    causal = torch.ones(21, 21, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    dense = torch.einsum("hqk,khd->qhd", probs, v)  # [21, 4, 64]
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)


def test_fast_path_has_no_host_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast backend must not read tensors back to the host (a sync on CUDA)."""
    case = make_attention_case(
        mixed_layout(16), num_heads=9, num_kv_heads=3, head_dim=64, block_size=16
    )
    k_cache, v_cache = case.clone_caches()

    def boom(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("host sync in the fast attention path")

    for method in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__", "numpy"):
        monkeypatch.setattr(torch.Tensor, method, boom)
    TorchPagedAttention().forward(
        case.query, case.key, case.value, k_cache, v_cache, case.meta, case.scale
    )


def test_get_attention_backend() -> None:
    assert isinstance(get_attention_backend(), TorchPagedAttention)
    assert isinstance(get_attention_backend("torch"), TorchPagedAttention)
    assert isinstance(get_attention_backend("reference"), ReferenceAttention)
    with pytest.raises(ValueError, match="reference"):
        get_attention_backend("flash")


def test_gqa_shape_mismatch_is_rejected() -> None:
    case = make_attention_case([(3, 1)], num_heads=4, num_kv_heads=3, head_dim=64, block_size=8)
    with pytest.raises(ValueError, match="multiple"):
        TorchPagedAttention().forward(
            case.query, case.key, case.value, *case.clone_caches(), case.meta, case.scale
        )


@st.composite
def batch_layouts(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([1, 4, 8, 16, 32]))
    num_heads, num_kv_heads = draw(st.sampled_from(HEADS + [(2, 2), (6, 3)]))
    decodes = draw(st.lists(st.integers(0, 70), max_size=5))
    prefills = draw(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 40)), max_size=4))
    seqs = [(c, 1) for c in decodes] + prefills
    if not seqs:
        seqs = [(0, 1)]
    return dict(
        seqs=seqs,
        num_decodes=len(decodes),
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from([8, 64])),
        extra_table_cols=draw(st.integers(0, 2)),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=60, deadline=None)
@given(batch_layouts())
def test_random_layouts(layout: dict) -> None:
    case = make_attention_case(**layout)
    check_case(case)


def test_decode_groups_cover_rows_and_bound_padding():
    from pagedlm.attention.torch_paged import decode_groups

    lens = [2000, 1900, 1500, 1200, 1000, 900, 500, 100, 50, 10, 10, 9]
    groups = decode_groups(lens, min_fill=0.8)
    assert groups[0][0] == 0 and groups[-1][1] == len(lens)
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))  # contiguous, no gaps
    for start, end, max_len in groups:
        rows = lens[start:end]
        assert max_len == max(rows)
        assert len(rows) == 1 or sum(rows) >= 0.8 * max_len * len(rows)
    assert decode_groups([7, 7, 7]) == [(0, 3, 7)]


def test_length_bucketed_decodes_match_reference():
    """Decodes of very different lengths (several buckets) against the reference."""
    from pagedlm.attention.backends import get_attention_backend
    from pagedlm.attention.testing import make_attention_case

    layout = [(n - 1, 1) for n in (300, 290, 120, 64, 17, 16, 3, 1)] + [(5, 9), (0, 12)]
    case = make_attention_case(layout, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16,
                               dtype=torch.float32, seed=3, num_decodes=8)
    fast = get_attention_backend("torch")
    ref = get_attention_backend("reference")
    out_fast = fast.forward(case.query, case.key, case.value, case.k_cache.clone(),
                            case.v_cache.clone(), case.meta, case.scale)
    out_ref = ref.forward(case.query, case.key, case.value, case.k_cache.clone(),
                          case.v_cache.clone(), case.meta, case.scale)
    assert len(case.meta.backend_cache["decode_groups"]) > 2
    torch.testing.assert_close(out_fast, out_ref, atol=1e-5, rtol=1e-5)


def _direct_alibi_slopes(n: int) -> list[float]:
    """The ALiBi paper's rule, written out: 2^(-8k/n) for k = 1..n when n is a power of two;
    otherwise the slopes of the largest power of two p < n, then the odd-k slopes of 2p heads."""
    p = 1
    while p * 2 <= n:
        p *= 2
    first = [2.0 ** (-8.0 * k / p) for k in range(1, p + 1)]
    extra = [2.0 ** (-8.0 * k / (2 * p)) for k in range(1, 2 * p + 1, 2)]
    return first + extra[: n - p]


@pytest.mark.parametrize("num_heads", [1, 2, 3, 4, 6, 8, 12, 16, 20, 32, 40])
def test_alibi_slopes_match_formula(num_heads: int) -> None:
    got = alibi_slopes(num_heads)
    assert got.shape == (num_heads,) and got.dtype == torch.float32
    expected = torch.tensor(_direct_alibi_slopes(num_heads), dtype=torch.float32)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    assert len(set(got.tolist())) == num_heads


def test_alibi_slopes_power_of_two_values() -> None:
    assert alibi_slopes(8).tolist() == [2.0**-k for k in range(1, 9)]
    assert alibi_slopes(6).tolist() == [0.25, 0.0625, 2.0**-6, 2.0**-8, 0.5, 0.125]


@pytest.mark.parametrize("heads", [(4, 4), (6, 6), (9, 3), (8, 1)], ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("block_size", [8, 16])
def test_mixed_batch_alibi(block_size: int, heads: tuple[int, int]) -> None:
    num_heads, num_kv_heads = heads
    case = make_attention_case(mixed_layout(block_size), num_heads=num_heads, num_kv_heads=num_kv_heads,
                               head_dim=64, block_size=block_size, seed=block_size + num_heads)
    slopes = alibi_slopes(num_heads)
    assert check_case(case, f"alibi bs{block_size} {heads}", slopes=slopes) < 1e-5
    # Not vacuous: the bias changes the output of every request with more than one key.
    k_cache, v_cache = case.clone_caches()
    plain = TorchPagedAttention().forward(case.query, case.key, case.value, k_cache, v_cache,
                                          case.meta, case.scale)
    k_cache, v_cache = case.clone_caches()
    biased = TorchPagedAttention().forward(case.query, case.key, case.value, k_cache, v_cache,
                                           case.meta, case.scale, alibi_slopes=slopes)
    assert (plain - biased).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_batch_alibi_low_precision(dtype: torch.dtype) -> None:
    case = make_attention_case(mixed_layout(16), num_heads=6, num_kv_heads=2, head_dim=64,
                               block_size=16, dtype=dtype, seed=7)
    check_case(case, "alibi", slopes=alibi_slopes(6))


def test_reference_alibi_matches_dense_formula() -> None:
    """One fresh prompt: softmax(q k^T * scale + slope_h * (j - i), causal) v, done densely."""
    num_heads = 6
    case = make_attention_case([(0, 13)], num_heads=num_heads, num_kv_heads=num_heads, head_dim=32,
                               block_size=4)
    slopes = alibi_slopes(num_heads)
    k_cache, v_cache = case.clone_caches()
    got = ReferenceAttention().forward(case.query, case.key, case.value, k_cache, v_cache, case.meta,
                                       case.scale, alibi_slopes=slopes)
    q, k, v = (t.transpose(0, 1).double() for t in (case.query, case.key, case.value))
    pos = torch.arange(13)
    scores = q @ k.transpose(1, 2) * case.scale  # [h, 13, 13]
    scores = scores + slopes.double()[:, None, None] * (pos[None, :] - pos[:, None])
    scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    expected = (scores.softmax(-1) @ v).transpose(0, 1).float()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# ----- sliding window and logit soft-capping -----------------------------------------------


def window_layout(bs: int) -> list[tuple[int, int]]:
    """Decodes and chunks whose contexts run several windows past the start."""
    decodes = [(0, 1), (5, 1), (bs, 1), (4 * bs - 1, 1), (6 * bs + 3, 1), (70, 1)]
    prefills = [
        (0, 3 * bs + 5),  # fresh prompt longer than the window
        (3 * bs + 1, 2 * bs),  # chunk far past the window, mid-block
        (2 * bs, 1),  # one-token chunk
        (bs - 1, bs + 2),  # chunk whose window reaches back into the prefix
    ]
    return decodes + prefills


@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)], ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [1, 7, 16, 33])
def test_sliding_window_matches_reference(window: int, block_size: int, heads: tuple[int, int]) -> None:
    """Invisible leading blocks are the null block, full of NaN: neither backend may read them."""
    num_heads, num_kv_heads = heads
    case = make_attention_case(window_layout(block_size), num_heads=num_heads, num_kv_heads=num_kv_heads,
                               head_dim=32, block_size=block_size, seed=window + block_size,
                               num_decodes=6, sliding_window=window)
    assert check_case(case, f"window {window} bs{block_size} {heads}", sliding_window=window) < 1e-5


@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)], ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("cap", [0.5, 50.0])
def test_soft_cap_matches_reference(cap: float, heads: tuple[int, int]) -> None:
    num_heads, num_kv_heads = heads
    case = make_attention_case(mixed_layout(8), num_heads=num_heads, num_kv_heads=num_kv_heads,
                               head_dim=64, block_size=8, seed=num_heads)
    assert check_case(case, f"softcap {cap} {heads}", logits_soft_cap=cap) < 1e-5


@pytest.mark.parametrize("with_alibi", [False, True])
@pytest.mark.parametrize("heads", [(6, 6), (6, 2)], ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_window_soft_cap_and_alibi_combined(heads: tuple[int, int], with_alibi: bool) -> None:
    num_heads, num_kv_heads = heads
    case = make_attention_case(window_layout(8), num_heads=num_heads, num_kv_heads=num_kv_heads,
                               head_dim=32, block_size=8, seed=11, num_decodes=6, sliding_window=13)
    slopes = alibi_slopes(num_heads) if with_alibi else None
    check_case(case, "window+softcap", slopes=slopes, sliding_window=13, logits_soft_cap=1.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_window_soft_cap_low_precision(dtype: torch.dtype) -> None:
    case = make_attention_case(window_layout(16), num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                               dtype=dtype, seed=5, num_decodes=6, sliding_window=24)
    check_case(case, "window", sliding_window=24)
    check_case(case, "window+softcap", sliding_window=24, logits_soft_cap=20.0)


def test_window_and_soft_cap_change_the_output() -> None:
    """Not vacuous: each option changes every request that has keys it affects, and a
    window at least as long as every context changes nothing."""
    case = make_attention_case(window_layout(8), num_heads=4, num_kv_heads=2, head_dim=32, block_size=8,
                               seed=2, num_decodes=6, fill=0.0)

    def run(**options: object) -> torch.Tensor:
        return TorchPagedAttention().forward(case.query, case.key, case.value, *case.clone_caches(),
                                             case.meta, case.scale, **options)

    plain = run()
    assert (run(sliding_window=9) - plain).abs().max() > 1e-2
    assert (run(logits_soft_cap=0.3) - plain).abs().max() > 1e-2
    torch.testing.assert_close(run(sliding_window=case.meta.max_seq_len), plain, atol=1e-6, rtol=1e-6)


@settings(max_examples=40, deadline=None)
@given(batch_layouts(), st.integers(1, 40), st.sampled_from([None, 0.8, 30.0]))
def test_random_layouts_window_soft_cap(layout: dict, window: int, cap: float | None) -> None:
    case = make_attention_case(**layout, sliding_window=window)
    check_case(case, sliding_window=window, logits_soft_cap=cap)


def _dense_attention(q, k, v, scale, window=None, cap=None, slopes=None):
    """softmax(cap * tanh(q k^T * scale / cap) + slope_h (j - i), causal & window) v, in float64."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.transpose(0, 1).double() for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    n = q.shape[1]
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    scores = q @ k.transpose(1, 2) * scale  # [h, n, n]
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    if slopes is not None:
        scores = scores + slopes.double()[:, None, None] * (j - i)
    visible = (j <= i) if window is None else (j <= i) & (i - j < window)
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).float()  # [n, h, d]


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("options", [dict(window=5), dict(cap=2.0), dict(window=6, cap=2.0, alibi=True)],
                         ids=["window", "softcap", "all"])
def test_window_soft_cap_match_dense_formula(backend: str, options: dict) -> None:
    """A fresh prompt, then each of its tokens decoded one at a time against the cache the
    prompt wrote, both equal the dense masked formula (i - j < W: W keys, itself included)."""
    n, num_heads, num_kv_heads = 23, 6, 2
    slopes = alibi_slopes(num_heads) if options.get("alibi") else None
    window, cap = options.get("window"), options.get("cap")
    kwargs = {k: v for k, v in dict(sliding_window=window, logits_soft_cap=cap, alibi_slopes=slopes).items()
              if v is not None}
    case = make_attention_case([(0, n)], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32,
                               block_size=4)
    expected = _dense_attention(case.query, case.key, case.value, case.scale, window, cap, slopes)
    impl = get_attention_backend(backend)
    k_cache, v_cache = case.clone_caches()
    got = impl.forward(case.query, case.key, case.value, k_cache, v_cache, case.meta, case.scale, **kwargs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    # Decode query t again against the written cache (a one-token step at position t).
    meta = case.meta
    for t in (0, 4, 9, n - 1):
        step = type(meta)(
            num_decodes=1, num_decode_tokens=1, num_prefills=0, num_tokens=1, max_query_len=1,
            max_seq_len=t + 1, query_start_loc=torch.tensor([0, 1]), seq_lens=torch.tensor([t + 1]),
            block_tables=meta.block_tables, slot_mapping=meta.slot_mapping[t : t + 1],
            query_start_loc_cpu=[0, 1], seq_lens_cpu=[t + 1],
        )
        out = impl.forward(case.query[t : t + 1], case.key[t : t + 1], case.value[t : t + 1], k_cache,
                           v_cache, step, case.scale, **kwargs)
        torch.testing.assert_close(out[0], expected[t], atol=1e-5, rtol=1e-5)


def test_decode_gathers_only_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """A windowed decode reads W slots, not its whole context; groups are kept per window."""
    case = make_attention_case([(999, 1), (500, 1)], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                               sliding_window=24)
    gathered = []
    real = torch.Tensor.index_select

    def spy(self: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        gathered.append(index.numel())
        return real(self, dim, index)

    monkeypatch.setattr(torch.Tensor, "index_select", spy)
    TorchPagedAttention().forward(case.query, case.key, case.value, *case.clone_caches(), case.meta,
                                  case.scale, sliding_window=24)
    assert gathered and max(gathered) == 2 * 24  # both rows, 24 keys each, K and V
    assert ("decode_groups", 24) in case.meta.backend_cache


def test_window_soft_cap_have_no_host_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_attention_case(window_layout(16), num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                               num_decodes=6, sliding_window=20)
    k_cache, v_cache = case.clone_caches()

    def boom(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("host sync in the fast attention path")

    for method in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__", "numpy"):
        monkeypatch.setattr(torch.Tensor, method, boom)
    TorchPagedAttention().forward(case.query, case.key, case.value, k_cache, v_cache, case.meta, case.scale,
                                  sliding_window=20, logits_soft_cap=5.0)


class _RecordingBackend:
    name = "recording"

    def __init__(self) -> None:
        self.kwargs: dict = {}

    def forward(self, query, key, value, k_cache, v_cache, meta, scale, **kwargs):
        self.kwargs = kwargs
        return query


def test_attention_layer_passes_only_the_options_it_has() -> None:
    from pagedlm.layers.attention import Attention

    case = make_attention_case([(0, 3)], num_heads=2, num_kv_heads=2, head_dim=8, block_size=4)
    for options in ({}, {"sliding_window": 4}, {"logits_soft_cap": 50.0},
                    {"sliding_window": 4, "logits_soft_cap": 50.0, "alibi_slopes": alibi_slopes(2)}):
        backend = _RecordingBackend()
        layer = Attention(2, 8, 0.3, 2, backend, **options)
        layer.k_cache, layer.v_cache = case.clone_caches()
        layer(case.query, case.key, case.value, case.meta)
        assert set(backend.kwargs) == set(options)
    with pytest.raises(ValueError, match="sliding_window"):
        Attention(2, 8, 0.3, 2, _RecordingBackend(), sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        Attention(2, 8, 0.3, 2, _RecordingBackend(), logits_soft_cap=0.0)
