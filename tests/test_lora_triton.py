"""The Triton LoRA kernels against `lora_reference`, on CPU under the interpreter.

Without CUDA the kernels run in Triton's interpreter (numpy, one program at a time):
shapes are small, and the block sizes are shrunk in some cases so that the shrink loops
over several `in` tiles and the expand splits a slice into several (partial) row blocks.
With CUDA the same tests compile and run the real kernels.
"""


import numpy as np
import pytest
import torch

from tests.helpers import use_triton_interpreter

_ON_GPU = torch.cuda.is_available()
# Before triton or a kernel module is imported (tests/helpers.py says why).
use_triton_interpreter()
triton = pytest.importorskip("triton")

from pagedlm.layers import lora_triton as lt  # noqa: E402
from pagedlm.layers.lora import LoRAStep, LoRAWeights, lora_reference  # noqa: E402

if not _ON_GPU and isinstance(lt._shrink_kernel, triton.runtime.JITFunction):
    pytest.skip("lora_triton was imported in compiled mode", allow_module_level=True)

DEVICE = torch.device("cuda" if _ON_GPU else "cpu")

# fp32 sums in fp32 against the reference's fp64: a few ulps. Low precision: the reference
# rounds the delta to the output dtype and then the sum, the kernel only the sum (and the
# interpreter's fp32 -> bf16 cast truncates).
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=6e-2, rtol=3e-2),
}

QKV = [(0, 24), (24, 32), (32, 40)]


@pytest.fixture(autouse=True)
def one_thread():
    """The interpreter runs many tiny numpy ops; extra threads only add wake-ups."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def make_weights(in_features, slices, ranks, max_rank, dtype, seed=0):
    """Slot l holds an adapter of rank ranks[l] (0: an empty slot) on every slice."""
    gen = torch.Generator().manual_seed(seed)
    step = LoRAStep(DEVICE)
    w = LoRAWeights(in_features, slices, len(ranks), max_rank, dtype, DEVICE, step,
                    kernel=lt.lora_triton)
    for slot, r in enumerate(ranks):
        if r == 0:
            continue
        for s, (lo, hi) in enumerate(slices):
            a = torch.randn(r, in_features, generator=gen) / in_features**0.5
            b = torch.randn(hi - lo, r, generator=gen) / r**0.5
            w.set_slice(slot, s, a.to(DEVICE, dtype), b.to(DEVICE, dtype))
    return w, step


def check(x, w, step, slots, dtype):
    step.set(np.array(slots))
    y = torch.randn(x.shape[0], w.slices[-1][1], generator=torch.Generator().manual_seed(2))
    y = y.to(DEVICE, dtype)
    want = y.clone()
    lora_reference(x, want, w, step)
    got = y.clone()
    w.add_to(x, got)  # through the layer's hook: lora_triton
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    # Tokens without an adapter, or on an empty slot, are left untouched (bit for bit).
    ranks = w.ranks_list
    for t, slot in enumerate(slots):
        if slot < 0 or ranks[slot] == 0:
            assert torch.equal(got[t], y[t]), (t, slot)


@pytest.mark.parametrize("small_blocks", [False, True], ids=["default", "small_blocks"])
@pytest.mark.parametrize("in_features, slices, slots", [
    (32, QKV, [0]),
    (48, QKV, [1, -1, 0, 2, 1]),
    (48, [(0, 40)], [2, 0, -1, 1, 0]),
    (32, [(0, 24), (24, 48)], [-1, 0]),
])
def test_matches_reference(monkeypatch, small_blocks, in_features, slices, slots):
    if small_blocks:  # several `in` tiles, several (partial) row blocks per slice
        monkeypatch.setattr(lt, "TILE_K", 16)
        monkeypatch.setattr(lt, "TILE_N", 16)
    w, step = make_weights(in_features, slices, [8, 4, 0], 8, torch.float32)
    x = torch.randn(len(slots), in_features, generator=torch.Generator().manual_seed(1))
    check(x.to(DEVICE), w, step, slots, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision(dtype):
    w, step = make_weights(48, QKV, [8, 4, 0], 8, dtype)
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    check(x, w, step, [1, -1, 0, 2, 1], dtype)


def test_rank_not_power_of_two_and_strided_input(monkeypatch):
    """R = 6 is padded to TILE_R = 8 under a mask; x is a column slice of a wider tensor."""
    monkeypatch.setattr(lt, "TILE_K", 16)
    w, step = make_weights(40, QKV, [6, 3, 0], 6, torch.float32)
    wide = torch.randn(5, 56, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    x = wide[:, 8:48]
    assert not x.is_contiguous()
    check(x, w, step, [0, 1, -1, 2, 0], torch.float32)
