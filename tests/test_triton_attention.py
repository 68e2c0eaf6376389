"""The Triton kernels against the loop-based reference, on CPU under the interpreter.

Without CUDA the kernels run in Triton's interpreter (numpy, one program at a time),
which is slow: shapes here are small, and only a few cases are long enough to make
the decode split its contexts. With CUDA the same tests compile and run the real
kernels, and `test_gpu_larger_shapes` adds bigger ones.
"""

import inspect
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import use_triton_interpreter

_ON_GPU = torch.cuda.is_available()
# Before triton or a kernel module is imported (tests/helpers.py says why).
use_triton_interpreter()
pytest.importorskip("triton")

from pagedlm.attention import triton_decode as td  # noqa: E402
from pagedlm.attention import triton_kernels as tk  # noqa: E402
from pagedlm.attention import triton_prefill as tp  # noqa: E402
from pagedlm.attention.alibi import alibi_slopes  # noqa: E402
from pagedlm.attention.backends import get_attention_backend  # noqa: E402
from pagedlm.attention.reference import ReferenceAttention  # noqa: E402
from pagedlm.attention.testing import AttentionCase, make_attention_case  # noqa: E402
from pagedlm.attention.triton_backend import TritonPagedAttention  # noqa: E402

if not _ON_GPU and not tk._INTERPRETED:
    pytest.skip("triton_kernels was imported in compiled mode", allow_module_level=True)

DEVICE = "cuda" if _ON_GPU else "cpu"

# fp32 runs the dots in ieee fp32: as tight as the torch backend. Low precision rounds
# the probabilities to the value dtype before P @ V (as FlashAttention does) and the
# output once more: a couple of ulps of the output dtype.
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=4e-2, rtol=2e-2),
}


@pytest.fixture(autouse=True)
def one_thread():
    """The interpreter runs many tiny numpy ops; extra threads only add wake-ups."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def mixed_layout(bs: int) -> list[tuple[int, int]]:
    """Decodes first (contexts 1, bs-1, bs, 3bs-1, 2bs+6), then prompts and chunks."""
    decodes = [(0, 1), (bs - 2, 1), (bs - 1, 1), (3 * bs - 2, 1), (2 * bs + 5, 1)]
    prefills = [
        (0, bs),  # fresh prompt, exactly one block
        (0, 7),  # fresh prompt, partial block
        (bs, bs),  # chunk continuing at a block boundary
        (5, 2 * bs + 3),  # chunk starting mid-block, spanning blocks
        (2 * bs - 1, 1),  # one-token chunk in the prefill section
    ]
    return decodes + prefills


def make_case(seqs, heads=(8, 2), head_dim=64, block_size=16, **kw) -> AttentionCase:
    return make_attention_case(
        seqs, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
        block_size=block_size, device=DEVICE, **kw,
    )


def expected_caches(case: AttentionCase) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache, v_cache = case.clone_caches()
    bs = k_cache.shape[1]
    for t, slot in enumerate(case.meta.slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // bs, slot % bs] = case.key[t]
            v_cache[slot // bs, slot % bs] = case.value[t]
    return k_cache, v_cache


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def assert_same_cache(actual: torch.Tensor, expected: torch.Tensor, src: torch.dtype) -> None:
    """Bit-equal, except that the interpreter (triton 3.9) converts fp32 -> bf16 by
    truncation where the GPU and torch round to nearest: one bf16 ulp apart."""
    if tk._INTERPRETED and src == torch.float32 and actual.dtype == torch.bfloat16:
        torch.testing.assert_close(actual, expected, rtol=2**-7, atol=0, equal_nan=True)
    else:
        assert_same_bits(actual, expected)


def check(case: AttentionCase, backend: TritonPagedAttention | None = None) -> float:
    """Triton vs reference on copies of the cache: outputs close, caches bit-equal."""
    k_ref, v_ref = case.clone_caches()
    k_tri, v_tri = case.clone_caches()
    args = (case.query, case.key, case.value)
    ref = ReferenceAttention().forward(*args, k_ref, v_ref, case.meta, case.scale)
    out = (backend or TritonPagedAttention()).forward(*args, k_tri, v_tri, case.meta, case.scale)
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    assert torch.isfinite(out).all()
    diff = (out.float() - ref.float()).abs().max().item()
    print(f"{case.query.dtype} {tuple(case.query.shape)} max abs diff {diff:.3e}")
    torch.testing.assert_close(out, ref, **TOL[case.query.dtype])
    assert_same_cache(k_tri, k_ref, case.key.dtype)
    assert_same_cache(v_tri, v_ref, case.value.dtype)
    return diff


def num_splits_used(case: AttentionCase) -> int:
    plans = [v for k, v in case.meta.backend_cache.items() if k[0] == "triton_decode"]
    assert len(plans) == 1
    return plans[0][0]


# ----------------------------------------------------------------------------- KV write


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_exact_slots_and_padding(dtype: torch.dtype) -> None:
    """Every real token lands bit-exactly in its slot; -1 (CUDA-graph padding) writes
    nothing; key/value may be strided (sliced out of a fused qkv)."""
    case = make_case(mixed_layout(16), heads=(9, 3), dtype=dtype)
    slots = case.meta.slot_mapping.clone()
    slots[::4] = -1
    padded = torch.cat([slots, torch.full((3,), -1, device=DEVICE)])  # trailing padding
    n = padded.shape[0]
    kv = torch.randn(n, 2, 3, 64, device=DEVICE).to(dtype)
    key, value = kv[:, 0], kv[:, 1]  # [n, 3, 64] each, token stride 6 * 64
    assert not key.is_contiguous()
    k_cache, v_cache = case.clone_caches()
    tk.write_kv_cache(key, value, k_cache, v_cache, padded)

    k_exp, v_exp = case.clone_caches()
    real = padded >= 0
    k_exp.view(-1, 3, 64)[padded[real]] = key[real]
    v_exp.view(-1, 3, 64)[padded[real]] = value[real]
    assert_same_bits(k_cache, k_exp)
    assert_same_bits(v_cache, v_exp)


# ----------------------------------------------------------------------- vs reference


@pytest.mark.parametrize(
    "head_dim,block_size,heads,dtype",
    [
        (64, 16, (4, 4), torch.float32),  # MHA
        (128, 16, (8, 2), torch.float32),  # GQA 4
        (64, 32, (8, 4), torch.float32),  # GQA 2
        (128, 32, (8, 1), torch.float32),  # MQA
        (64, 16, (9, 3), torch.float16),  # GQA 3: group padded to 4 rows
        (128, 32, (8, 2), torch.bfloat16),
    ],
    ids=["d64-bs16-mha", "d128-bs16-gqa4", "d64-bs32-gqa2", "d128-bs32-mqa", "fp16", "bf16"],
)
def test_mixed_batch(head_dim: int, block_size: int, heads: tuple[int, int], dtype) -> None:
    case = make_case(mixed_layout(block_size), heads, head_dim, block_size, dtype=dtype,
                     seed=head_dim + block_size)
    assert case.meta.num_decodes == 5 and case.meta.num_prefills == 5
    check(case)


@pytest.mark.parametrize("head_dim", [16, 32])
def test_small_head_dims(head_dim: int) -> None:
    check(make_case([(20, 1), (0, 1), (3, 18)], (4, 2), head_dim, block_size=16))


def test_prefill_only() -> None:
    """Fresh prompts: exact block multiples, a partial one, length 1, several q tiles."""
    check(make_case([(0, 33), (0, 64), (0, 1), (0, 100)], (8, 2)))


def test_chunked_prefill_over_cached_prefix() -> None:
    """Chunks after a cached prefix, incl. a one-token chunk among the prefills.

    Prefixes 62 and 63 put the causal diagonal of a query tile one key before, and
    exactly on, a 64-key tile boundary (where the unmasked key range ends).
    """
    seqs = [(130, 20), (64, 64), (200, 1), (5, 70), (62, 40), (63, 3)]
    case = make_case(seqs, (6, 2), block_size=32)
    assert case.meta.num_decodes == 0
    check(case)


def test_decode_split_k() -> None:
    """Long and short decodes in one launch: 4 splits; short ones leave splits empty."""
    case = make_case([(n - 1, 1) for n in (700, 513, 256, 64, 17, 16, 1)], (8, 2))
    check(case)
    assert num_splits_used(case) == 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_split_k_low_precision(dtype: torch.dtype) -> None:
    case = make_case([(599, 1), (300, 1), (31, 1)], (8, 1), 128, block_size=32, dtype=dtype)
    check(case)
    assert num_splits_used(case) == 4


def test_many_splits_with_chunked_prefill() -> None:
    """8 splits (tuned down) in the same step as prefill chunks over a cached prefix."""
    backend = TritonPagedAttention(min_tokens_per_split=64, max_splits=8)
    case = make_case([(500, 1), (40, 1), (300, 40), (0, 17)], (4, 1), block_size=16)
    check(case, backend)
    assert num_splits_used(case) == 8


# In the reduce, a padding row's -inf - -inf is computed, then discarded by tl.where;
# numpy (the interpreter) warns about it.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("max_splits", [1, 16])
def test_padding_decode_rows(max_splits: int) -> None:
    """A padding row (seq_len 0, slot -1, as CUDA-graph batches are padded) writes
    nothing, reads nothing, and outputs 0; the real rows are unaffected."""
    case = make_case([(299, 1), (40, 1), (0, 1)], (4, 2))
    k_ref, v_ref = case.clone_caches()
    ref = ReferenceAttention().forward(case.query, case.key, case.value, k_ref, v_ref,
                                       case.meta, case.scale)
    meta = case.meta
    meta.seq_lens[2] = 0
    meta.seq_lens_cpu[2] = 0
    meta.slot_mapping[2] = -1
    k_tri, v_tri = case.clone_caches()
    out = TritonPagedAttention(max_splits=max_splits).forward(
        case.query, case.key, case.value, k_tri, v_tri, meta, case.scale
    )
    assert num_splits_used(case) == min(max_splits, 2)
    torch.testing.assert_close(out[:2], ref[:2], **TOL[torch.float32])
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    k_exp, v_exp = case.clone_caches()
    k_exp.view(-1, 2, 64)[meta.slot_mapping[:2]] = case.key[:2]
    v_exp.view(-1, 2, 64)[meta.slot_mapping[:2]] = case.value[:2]
    assert_same_bits(k_tri, k_exp)
    assert_same_bits(v_tri, v_exp)


def test_cache_in_other_dtype() -> None:
    """A bf16 cache under fp32 activations: both read back the rounded K/V.

    The new K/V are made bf16-representable, so that the cache write is exact under
    any rounding (the interpreter truncates fp32 -> bf16, see assert_same_cache).
    """
    case = make_case(mixed_layout(16)[2:8], (8, 2), cache_dtype=torch.bfloat16)
    case.key = case.key.to(torch.bfloat16).float()
    case.value = case.value.to(torch.bfloat16).float()
    check(case)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float8_cache(cache_dtype: torch.dtype, dtype: torch.dtype) -> None:
    """A float8 cache (--kv-cache-dtype fp8), written from float8 K/V as the attention layer
    passes them (quantised by torch, so the write is a copy): rows read back as the
    reference reads them, on decodes and prefills alike."""
    case = make_case(mixed_layout(16)[2:9], (8, 2), dtype=dtype, cache_dtype=cache_dtype)
    case.key = case.key.to(cache_dtype)
    case.value = case.value.to(cache_dtype)
    k_ref, v_ref = case.clone_caches()
    k_tri, v_tri = case.clone_caches()
    args = (case.query, case.key, case.value)
    ref = ReferenceAttention().forward(*args, k_ref, v_ref, case.meta, case.scale)
    out = TritonPagedAttention().forward(*args, k_tri, v_tri, case.meta, case.scale)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert torch.equal(k_tri.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_tri.view(torch.uint8), v_ref.view(torch.uint8))


def test_strided_inputs_from_fused_qkv() -> None:
    case = make_case(mixed_layout(16)[3:8], (6, 2))
    t = case.query.shape[0]
    qkv = torch.cat([case.query.flatten(1), case.key.flatten(1), case.value.flatten(1)], dim=1)
    case.query = qkv[:, : 6 * 64].view(t, 6, 64)  # row stride 10 * 64
    case.key = qkv[:, 6 * 64 : 8 * 64].view(t, 2, 64)
    case.value = qkv[:, 8 * 64 :].view(t, 2, 64)
    assert not case.query.is_contiguous()
    check(case)


# --------------------------------------------------- ALiBi, sliding window, soft-capping

# True once the reference backend takes the options (another change adds them); until
# then the kernels are checked against `dense_attention` alone.
_REFERENCE_HAS_OPTIONS = "sliding_window" in inspect.signature(ReferenceAttention.forward).parameters


def dense_attention(case: AttentionCase, alibi_slopes: torch.Tensor | None = None,
                    sliding_window: int | None = None,
                    logits_soft_cap: float | None = None) -> torch.Tensor:
    """The attention the options define, in float64 on each request's whole context at
    once: scores (q.k) * scale, then cap * tanh(s / cap), then + slope_h * (j - i); key j
    seen by query i iff j <= i and i - j < window. Context K/V come from the cache as it
    is after this step's write (`expected_caches`), gathered by position."""
    meta = case.meta
    k_cache, v_cache = (c.cpu() for c in expected_caches(case))
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = case.query.shape[1] // num_kv_heads
    tables = meta.block_tables.cpu()
    out = torch.zeros(case.query.shape, dtype=torch.float64)
    for r in range(meta.num_seqs):
        start, end = meta.query_start_loc_cpu[r], meta.query_start_loc_cpu[r + 1]
        ctx = meta.seq_lens_cpu[r]
        j = torch.arange(ctx)  # key positions
        slots = tables[r, j // block_size] * block_size + j % block_size
        k = k_cache.view(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, 1)
        v = v_cache.view(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, 1)
        q = case.query[start:end].cpu().double()  # [q_len, num_heads, head_dim]
        s = torch.einsum("qhd,khd->hqk", q, k) * case.scale  # [num_heads, q_len, ctx]
        if logits_soft_cap is not None:
            s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        i = torch.arange(ctx - (end - start), ctx)[:, None]  # query positions
        if alibi_slopes is not None:
            s = s + alibi_slopes.cpu().double()[:, None, None] * (j[None, :] - i)
        seen = j[None, :] <= i
        if sliding_window is not None:
            seen &= i - j[None, :] < sliding_window
        s = s.masked_fill(~seen, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)
    return out.to(case.query.dtype).to(case.query.device)


def free_blocks_outside_window(case: AttentionCase, window: int) -> int:
    """Point every block-table entry of a block that lies wholly before the window of a
    request's first query token at an unused block full of NaN, as an engine that frees
    those blocks may leave them. Returns how many entries were replaced."""
    meta = case.meta
    block_size = case.k_cache.shape[1]
    in_use = set(meta.block_tables.flatten().tolist())
    freed = next(b for b in range(case.k_cache.shape[0]) if b not in in_use)
    assert torch.isnan(case.k_cache[freed]).all() and torch.isnan(case.v_cache[freed]).all()
    count = 0
    for r in range(meta.num_seqs):
        q_len = meta.query_start_loc_cpu[r + 1] - meta.query_start_loc_cpu[r]
        first_key = meta.seq_lens_cpu[r] - q_len - window + 1  # of the first query token
        num_freed = max(first_key, 0) // block_size
        meta.block_tables[r, :num_freed] = freed
        count += num_freed
    return count


def check_options(case: AttentionCase, backend: TritonPagedAttention | None = None,
                  **options) -> None:
    """Triton with options vs `dense_attention` (and the reference, once it has them).
    With a window, blocks before it are freed (NaN) first: reading one would show."""
    expected = dense_attention(case, **options)
    if _REFERENCE_HAS_OPTIONS:
        k_ref, v_ref = case.clone_caches()
        ref = ReferenceAttention().forward(case.query, case.key, case.value, k_ref, v_ref,
                                           case.meta, case.scale, **options)
        torch.testing.assert_close(ref, expected, **TOL[case.query.dtype])
    if options.get("sliding_window") is not None:
        assert free_blocks_outside_window(case, options["sliding_window"]) > 0
    k_tri, v_tri = case.clone_caches()
    out = (backend or TritonPagedAttention()).forward(
        case.query, case.key, case.value, k_tri, v_tri, case.meta, case.scale, **options
    )
    assert torch.isfinite(out).all()
    diff = (out.float() - expected.float()).abs().max().item()
    print(f"{options} {case.query.dtype} max abs diff {diff:.3e}")
    torch.testing.assert_close(out, expected, **TOL[case.query.dtype])


def slopes_for(num_heads: int) -> torch.Tensor:
    return alibi_slopes(num_heads).to(DEVICE)


@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha-4", "gqa3-6heads"])
def test_alibi_mixed_batch(heads: tuple[int, int]) -> None:
    """ALiBi on decodes and prefill chunks; 6 heads (GQA 3) have the non-power-of-two
    slopes, each query row of a kv head's tile taking its own head's slope."""
    case = make_case(mixed_layout(16), heads, head_dim=32, seed=heads[0])
    check_options(case, alibi_slopes=slopes_for(heads[0]))


@pytest.mark.parametrize("window", [5, 24])
def test_sliding_window_mixed_batch(window: int) -> None:
    """Windows smaller than most contexts: 5 is below a block and a key tile (the
    first tile after the diagonal-free part starts before the window), 24 spans blocks;
    blocks wholly before a request's window are freed."""
    case = make_case(mixed_layout(16), (8, 2), head_dim=32, seed=window)
    check_options(case, sliding_window=window)


def test_sliding_window_split_k_and_long_chunks() -> None:
    """Long decodes with a window split the window's span, not the whole context
    (span 300 + 63 -> 2 splits of 192, where the full 700 would take 4); long prefill
    chunks cross the window's start mid-tile."""
    case = make_case([(699, 1), (400, 1), (90, 1), (250, 70), (0, 90)], (4, 1), head_dim=32)
    check_options(case, sliding_window=300)
    assert num_splits_used(case) == 2


def test_soft_cap() -> None:
    """A cap of 1.5 on scores of ~N(0, 1) changes many of them substantially."""
    case = make_case(mixed_layout(16)[2:9], (8, 2), head_dim=32)
    check_options(case, logits_soft_cap=1.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_options_together(dtype: torch.dtype) -> None:
    """Soft cap, then ALiBi (GQA 2), then the window; split-K decodes and chunks."""
    backend = TritonPagedAttention(min_tokens_per_split=32)
    case = make_case([(150, 1), (20, 1), (3, 40), (60, 9)], (4, 2), head_dim=32, dtype=dtype,
                     block_size=8)
    check_options(case, backend, alibi_slopes=slopes_for(4), sliding_window=45,
                  logits_soft_cap=2.0)
    assert num_splits_used(case) == 4


def test_option_errors() -> None:
    backend = TritonPagedAttention()
    case = make_case([(3, 1)], (4, 2), head_dim=16)
    args = (case.query, case.key, case.value, *case.clone_caches(), case.meta, case.scale)
    with pytest.raises(ValueError, match="alibi_slopes"):
        backend.forward(*args, alibi_slopes=slopes_for(2))
    with pytest.raises(ValueError, match="sliding_window=0"):
        backend.forward(*args, sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap=0"):
        backend.forward(*args, logits_soft_cap=0.0)


# ------------------------------------------------------------------------ host side


class _Recorder:
    """Stands in for a @triton.jit kernel: records launches instead of running them."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append((self.name, grid, args, kwargs))


def test_launches_have_no_host_syncs_and_reuse_the_step_plan(monkeypatch) -> None:
    """Launch grids come from host lists only; the second layer reuses the first's plan."""
    case = make_case([(700, 1), (5, 1), (30, 9), (0, 4)], (8, 2))
    log: list = []
    for module, name in ((tk, "_write_kv_kernel"), (td, "_decode_split_kernel"),
                         (td, "_decode_reduce_kernel"), (tp, "_prefill_kernel")):
        monkeypatch.setattr(module, name, _Recorder(name, log))

    def boom(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("host sync in the triton attention path")

    backend = TritonPagedAttention()
    with monkeypatch.context() as m:
        for method in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__",
                       "numpy", "cpu"):
            m.setattr(torch.Tensor, method, boom)
        for _layer in range(2):
            backend.forward(case.query, case.key, case.value, *case.clone_caches(),
                            case.meta, case.scale)

    grids = {name: grid for name, grid, _, _ in log}
    assert grids == {
        "_write_kv_kernel": (15,),  # (tokens,)
        "_decode_split_kernel": (2, 2, 4),  # (decodes, kv heads, splits)
        "_decode_reduce_kernel": (2, 8),  # (decodes, q heads)
        "_prefill_kernel": (1, 2, 2),  # (q tiles of 32 tokens, kv heads, prefills)
    }
    partials = [args[7:10] for name, _, args, _ in log if name == "_decode_split_kernel"]
    assert all(a is b for a, b in zip(*partials))  # one allocation per step


def test_choose_num_splits() -> None:
    # Bounded by length (256 tokens a split), then rounded up to a power of two.
    assert td.choose_num_splits(100, 1, 8, 132) == 1
    assert td.choose_num_splits(257, 1, 8, 132) == 2
    assert td.choose_num_splits(700, 1, 8, 132) == 4
    assert td.choose_num_splits(100_000, 1, 8, 132) == 16  # max_splits
    # A batch that already fills the GPU twice over is not split.
    assert td.choose_num_splits(100_000, 64, 8, 132) == 1
    assert td.choose_num_splits(100_000, 8, 8, 132) == 8
    assert td.split_length(700, 4, 64) == 192  # ceil(175 / 64) * 64


def test_registered_backend_and_input_errors() -> None:
    backend = get_attention_backend("triton")
    assert isinstance(backend, TritonPagedAttention) and backend.name == "triton"
    case = make_case([(3, 1)], (4, 3))
    with pytest.raises(ValueError, match="multiple"):
        backend.forward(case.query, case.key, case.value, *case.clone_caches(), case.meta, case.scale)
    case = make_case([(3, 1)], (4, 2), head_dim=48)
    with pytest.raises(ValueError, match="head_dim=48"):
        backend.forward(case.query, case.key, case.value, *case.clone_caches(), case.meta, case.scale)


def test_backend_without_triton_installed(monkeypatch) -> None:
    """Without triton, the other backends still load and "triton" fails clearly."""
    import pagedlm.attention

    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises
    for name in ("triton_backend", "triton_decode", "triton_prefill", "triton_kernels"):
        # forget them, so that they are imported again
        monkeypatch.delitem(sys.modules, f"pagedlm.attention.{name}")
        monkeypatch.delattr(pagedlm.attention, name)
    assert get_attention_backend("torch").name == "torch"
    with pytest.raises(ImportError, match="'triton' needs a missing package"):
        get_attention_backend("triton")


# ----------------------------------------------------------------------- compile only

# Compiles each kernel for sm_90 (to PTX and SASS with the ptxas bundled in the triton
# wheel) in a process where the kernels are not interpreted. This catches what the
# interpreter accepts and the compiler does not (types, constexpr scoping, dot shapes).
# Pointer and stride arguments get the divisibility-by-16 hints a real launch infers.
_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedlm.attention import triton_decode as td, triton_kernels as tk, triton_prefill as tp

I64_PTRS = {"slot_mapping_ptr", "block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"}
FP32_PTRS = {"alibi_slopes_ptr", "part_m_ptr", "part_l_ptr", "part_acc_ptr"}
FP32_ARGS = {"qk_scale", "cap_scale"}

def build(fn, dtype, num_warps=4, **consts):
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in I64_PTRS:
            sig[name] = "*i64"
        elif name in FP32_PTRS:
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = "*" + dtype
        else:
            sig[name] = "fp32" if name in FP32_ARGS else "i32"
    hinted = [(i,) for i, n in enumerate(fn.arg_names) if n not in consts
              and (n.endswith("_ptr") or n.startswith("stride") or n == "split_len")]
    attrs = {k: [["tt.divisibility", 16]] for k in hinted}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))

unit = dict(stride_cd=1)
plain = dict(ALIBI=False, HAS_WINDOW=False, SOFTCAP=False)
every = dict(ALIBI=True, HAS_WINDOW=True, SOFTCAP=True)
for dtype, prec, decode_variants in (("bf16", None, (plain, every)), ("fp32", "ieee", (plain,))):
    build(tk._write_kv_kernel, dtype, stride_kd=1, stride_vd=1, BLOCK_SIZE=16, TILE_KVH=8,
          HEAD_DIM=128, **unit)
    for options in decode_variants:
        build(td._decode_split_kernel, dtype, stride_qd=1, stride_od=1, GROUP=4, TILE_H=16,
              HEAD_DIM=128, BLOCK_SIZE=16, TILE_N=td.DECODE_TILE_N, NUM_SPLITS=4,
              UPCAST=False, DOT_PREC=prec, **options, **unit)
    build(td._decode_reduce_kernel, dtype, 1, stride_od=1, HEAD_DIM=128, NUM_SPLITS=4,
          TILE_N=td.DECODE_TILE_N, HAS_WINDOW=dtype == "bf16")
for options in (plain, every):
    build(tp._prefill_kernel, "bf16", stride_qd=1, stride_od=1, GROUP=3, GROUP_PAD=4,
          TILE_M=16, HEAD_DIM=128, BLOCK_SIZE=32, TILE_N=tp.PREFILL_TILE_N, UPCAST=False,
          DOT_PREC=None, **options, **unit)
print("compiled")
"""


@pytest.mark.skipif(_ON_GPU, reason="on a GPU every test compiles the kernels for real")
def test_kernels_compile_for_sm90_without_a_gpu(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real every run
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences a 3.9 deprecation warning
    res = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=170)
    if res.returncode != 0 and "ptxas" in res.stderr and "No such file" in res.stderr:
        pytest.skip("this triton install has no ptxas")
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-4000:]


# ------------------------------------------------------------------------------- GPU


@pytest.mark.skipif(not _ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,block_size,heads", [(128, 16, (32, 8)), (64, 32, (14, 2))])
def test_gpu_larger_shapes(dtype, head_dim, block_size, heads) -> None:
    decodes = [(n - 1, 1) for n in (4000, 2500, 1024, 513, 100, 16, 1)] * 3
    prefills = [(1000, 200), (0, 512), (64, 129), (333, 1)]
    case = make_case(decodes + prefills, heads, head_dim, block_size, dtype=dtype,
                     num_decodes=len(decodes))
    check(case)
    assert num_splits_used(case) > 1


@pytest.mark.skipif(not _ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_options_larger_shapes(dtype) -> None:
    decodes = [(n - 1, 1) for n in (4000, 2500, 1024, 513, 100, 16, 1)] * 2
    prefills = [(1000, 200), (0, 512), (64, 129), (333, 1)]
    case = make_case(decodes + prefills, (16, 4), 128, 16, dtype=dtype, num_decodes=len(decodes))
    check_options(case, alibi_slopes=slopes_for(16), sliding_window=700, logits_soft_cap=30.0)
    assert num_splits_used(case) > 1
