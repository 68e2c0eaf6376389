"""The Triton kernels against the loop-based reference, on CPU under the interpreter.

Without CUDA the kernels run in Triton's interpreter (numpy, one program at a time),
which is slow: shapes here are small, and only a few cases are long enough to make
the decode split its contexts. With CUDA the same tests compile and run the real
kernels, and `test_gpu_larger_shapes` adds bigger ones.
"""

import os
import subprocess
import sys

import pytest
import torch

_ON_GPU = torch.cuda.is_available()
if not _ON_GPU:
    # Triton picks "compile" or "interpret" when @triton.jit decorates a function, i.e.
    # at import: for its own helpers (tl.max, tl.sum, tl.cdiv) when `triton` is first
    # imported, for our kernels when triton_kernels is. So the variable must be set
    # before either import, and it stays set for this process. If something imported
    # triton earlier, its helpers are compiled-mode and cannot run on CPU tensors.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1 could be set; run this file "
            "on its own or with TRITON_INTERPRET=1",
            allow_module_level=True,
        )
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from pagedlm.attention import triton_kernels as tk  # noqa: E402
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


def test_strided_inputs_from_fused_qkv() -> None:
    case = make_case(mixed_layout(16)[3:8], (6, 2))
    t = case.query.shape[0]
    qkv = torch.cat([case.query.flatten(1), case.key.flatten(1), case.value.flatten(1)], dim=1)
    case.query = qkv[:, : 6 * 64].view(t, 6, 64)  # row stride 10 * 64
    case.key = qkv[:, 6 * 64 : 8 * 64].view(t, 2, 64)
    case.value = qkv[:, 8 * 64 :].view(t, 2, 64)
    assert not case.query.is_contiguous()
    check(case)


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
    for name in ("_write_kv_kernel", "_decode_split_kernel", "_decode_reduce_kernel",
                 "_prefill_kernel"):
        monkeypatch.setattr(tk, name, _Recorder(name, log))

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
    partials = [args[6:9] for name, _, args, _ in log if name == "_decode_split_kernel"]
    assert all(a is b for a, b in zip(*partials))  # one allocation per step


def test_choose_num_splits() -> None:
    # Bounded by length (256 tokens a split), then rounded up to a power of two.
    assert tk.choose_num_splits(100, 1, 8, 132) == 1
    assert tk.choose_num_splits(257, 1, 8, 132) == 2
    assert tk.choose_num_splits(700, 1, 8, 132) == 4
    assert tk.choose_num_splits(100_000, 1, 8, 132) == 16  # max_splits
    # A batch that already fills the GPU twice over is not split.
    assert tk.choose_num_splits(100_000, 64, 8, 132) == 1
    assert tk.choose_num_splits(100_000, 8, 8, 132) == 8
    assert tk.split_length(700, 4, 64) == 192  # ceil(175 / 64) * 64


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
    for name in ("triton_backend", "triton_kernels"):  # forget them, so they re-import
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
from pagedlm.attention import triton_kernels as tk

I64_PTRS = {"slot_mapping_ptr", "block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"}

def build(fn, dtype, num_warps=4, **consts):
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in I64_PTRS:
            sig[name] = "*i64"
        elif name.startswith("part_"):
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = "*" + dtype
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    hinted = [(i,) for i, n in enumerate(fn.arg_names) if n not in consts
              and (n.endswith("_ptr") or n.startswith("stride") or n == "split_len")]
    attrs = {k: [["tt.divisibility", 16]] for k in hinted}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))

unit = dict(stride_cd=1)
for dtype, prec in (("bf16", None), ("fp32", "ieee")):
    build(tk._write_kv_kernel, dtype, stride_kd=1, stride_vd=1, BLOCK_SIZE=16, BLOCK_KVH=8,
          HEAD_DIM=128, **unit)
    build(tk._decode_split_kernel, dtype, stride_qd=1, stride_od=1, GROUP=4, BLOCK_H=16,
          HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_N=tk.DECODE_BLOCK_N, NUM_SPLITS=4, UPCAST=False,
          DOT_PREC=prec, **unit)
    build(tk._decode_reduce_kernel, dtype, 1, stride_od=1, HEAD_DIM=128, NUM_SPLITS=4)
build(tk._prefill_kernel, "bf16", stride_qd=1, stride_od=1, GROUP=3, GROUP_PAD=4, BLOCK_M=16,
      HEAD_DIM=128, BLOCK_SIZE=32, BLOCK_N=tk.PREFILL_BLOCK_N, UPCAST=False, DOT_PREC=None, **unit)
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
