"""The CPU LoRA kernels (`lora_grouped`, torch; `lora_cpu`, csrc/lora_cpu.cpp) against
`lora_reference`, and `LoRAStep`'s per-adapter token groups.

Slots hold adapters of different ranks (below max_lora_rank, and per slice), one slot is
empty; tokens without an adapter (slot -1) or on the empty slot must come out bit for bit
unchanged. The Triton kernel has its own file (test_lora_triton.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedlm.csrc import load_extension
from pagedlm.layers.lora import (
    LoRAStep,
    LoRAWeights,
    choose_kernel,
    lora_cpu,
    lora_grouped,
    lora_reference,
)

CPU = torch.device("cpu")
HAVE_CPU_KERNEL = load_extension("lora_cpu") is not None
needs_cpu_kernel = pytest.mark.skipif(not HAVE_CPU_KERNEL, reason="the C++ LoRA kernel could not be built")

KERNELS = [
    pytest.param(lora_grouped, id="grouped"),
    pytest.param(lora_cpu, id="cpu", marks=needs_cpu_kernel),
]

IN = 64
SHAPES = {
    "one-slice": [(0, 96)],
    "qkv": [(0, 64), (64, 80), (80, 96)],  # GQA: q wider than k and v
    "gate-up": [(0, 128), (128, 256)],
}
MAX_RANK = 8
# Slot -> rank of each slice (slot 2 is empty; slot 1 has a smaller rank on one slice, as
# a rank_pattern gives; every rank is below or at max_lora_rank).
SLOT_RANKS = [8, (4, 2, 4), 0, 3]
EMPTY_SLOT = 2


def make_weights(slices, kernel, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    step = LoRAStep(CPU)
    w = LoRAWeights(IN, slices, len(SLOT_RANKS), MAX_RANK, dtype, CPU, step, kernel=kernel)
    for slot, ranks in enumerate(SLOT_RANKS):
        if ranks == 0:
            continue
        for s, (lo, hi) in enumerate(slices):
            r = ranks if isinstance(ranks, int) else ranks[s % len(ranks)]
            a = torch.randn(r, IN, generator=gen) / IN**0.5
            b = torch.randn(hi - lo, r, generator=gen)
            w.set_slice(slot, s, a.to(dtype), b.to(dtype))
    return w, step


def run_and_check(kernel, slices, slots, x, dtype=torch.float32, tol=None, y=None):
    w, step = make_weights(slices, kernel, dtype)
    assert w.kernel is kernel
    step.set(np.asarray(slots, dtype=np.int64))
    if y is None:
        gen = torch.Generator().manual_seed(3)
        y = torch.randn(x.shape[0], slices[-1][1], generator=gen).to(dtype)
    want = y.clone()
    if step.active:  # (the reference wants a slot per token; base-only steps add nothing)
        lora_reference(x, want, w, step)
    got = y.clone()
    w.add_to(x, got)
    torch.testing.assert_close(got.float(), want.float(), **(tol or dict(atol=1e-5, rtol=1e-4)))
    for t, slot in enumerate(slots):
        if slot < 0 or w.ranks_list[slot] == 0:
            assert torch.equal(got[t], y[t]), (t, slot)  # untouched, bit for bit
        else:
            assert not torch.equal(got[t], y[t]), (t, slot)  # the delta was added
    return got


SLOT_PATTERNS = {
    "T1-adapter": [1],
    "T1-base": [-1],
    "T1-empty-slot": [EMPTY_SLOT],
    "contiguous": [0, 0, 0, 3, 3, -1, -1, 1],  # prompt chunks: one slice per adapter
    "interleaved": [1, -1, 1, 0, 3, 0, EMPTY_SLOT, 1, -1],  # decodes: index groups
    # Long prompt chunks next to decodes (lora_cpu may take runs as GEMMs, the rest
    # token by token), one run on the empty slot.
    "long-runs": [0] * 20 + [1, -1, 3] + [3] * 17 + [-1, 1] + [EMPTY_SLOT] * 16 + [1] * 3,
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pattern", list(SLOT_PATTERNS))
def test_matches_reference(kernel, shape, pattern):
    slots = SLOT_PATTERNS[pattern]
    x = torch.randn(len(slots), IN, generator=torch.Generator().manual_seed(1))
    run_and_check(kernel, SHAPES[shape], slots, x)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", ["qkv", "gate-up"])
def test_many_tokens(kernel, shape):
    """T = 300 is past the C++ kernel's grain: tokens are split across threads."""
    rng = np.random.default_rng(7)
    slots = rng.integers(-1, len(SLOT_RANKS), size=300).tolist()
    x = torch.randn(300, IN, generator=torch.Generator().manual_seed(1))
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = run_and_check(kernel, SHAPES[shape], slots, x)
        torch.set_num_threads(1)
        one = run_and_check(kernel, SHAPES[shape], slots, x)
    finally:
        torch.set_num_threads(saved)
    if kernel is lora_cpu:  # a token's sums do not depend on how tokens are split
        assert torch.equal(one, two)


@pytest.mark.parametrize("kernel", KERNELS)
def test_non_contiguous_input(kernel):
    """x a column slice of a wider tensor (row stride != in), as a fused layer hands it."""
    wide = torch.randn(9, IN + 24, generator=torch.Generator().manual_seed(1))
    x = wide[:, 16:16 + IN]
    assert not x.is_contiguous()
    slots = SLOT_PATTERNS["interleaved"]
    got = run_and_check(kernel, SHAPES["qkv"], slots, x)
    # The same as on a contiguous copy, bit for bit: the stride is only an address.
    again = run_and_check(kernel, SHAPES["qkv"], slots, x.contiguous())
    assert torch.equal(got, again)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_token_does_not_depend_on_the_batch(kernel):
    """The same token through the same adapter gives the same output alone or in a batch:
    bit for bit for lora_cpu (a token's sums depend on its own row only), within float32
    rounding for lora_grouped (a GEMM over the adapter's tokens)."""
    slices = SHAPES["qkv"]
    x = torch.randn(6, IN, generator=torch.Generator().manual_seed(4))
    y = torch.randn(6, 96, generator=torch.Generator().manual_seed(5))
    slots = [0, 1, 0, -1, 3, 0]
    batched = run_and_check(kernel, slices, slots, x, y=y)
    for t in range(6):
        alone = run_and_check(kernel, slices, [slots[t]], x[t:t + 1], y=y[t:t + 1])
        if kernel is lora_cpu:
            assert torch.equal(alone[0], batched[t]), t
        else:
            torch.testing.assert_close(alone[0], batched[t], atol=1e-5, rtol=1e-5)


def test_grouped_low_precision():
    x = torch.randn(9, IN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    run_and_check(lora_grouped, SHAPES["qkv"], SLOT_PATTERNS["interleaved"], x, torch.bfloat16,
                  tol=dict(atol=6e-2, rtol=3e-2))


@needs_cpu_kernel
def test_cpu_kernel_refuses_a_slot_out_of_range():
    w, step = make_weights(SHAPES["one-slice"], lora_cpu)
    step.set(np.array([0, len(SLOT_RANKS)]))
    x, y = torch.randn(2, IN), torch.zeros(2, 96)
    with pytest.raises((ValueError, RuntimeError), match="slot out of range"):
        w.add_to(x, y)


def test_inactive_step_leaves_output_alone():
    for kernel in (lora_grouped, *([lora_cpu] if HAVE_CPU_KERNEL else [])):
        w, step = make_weights(SHAPES["qkv"], kernel)
        x, y = torch.randn(3, IN), torch.randn(3, 96)
        before = y.clone()
        for slots in (None, np.array([-1, -1, -1])):
            step.set(slots)
            assert not step.active and step.token_slots is None
            w.add_to(x, y)
            assert torch.equal(y, before)


def test_choose_kernel():
    kernel, ext = choose_kernel(CPU, torch.float32)
    if HAVE_CPU_KERNEL:
        assert kernel is lora_cpu and ext is not None
    else:
        assert kernel is lora_grouped
    assert choose_kernel(CPU, torch.bfloat16) == (lora_grouped, None)


def test_clear_empties_a_slot():
    slices = SHAPES["qkv"]
    w, step = make_weights(slices, lora_grouped)
    w.clear(0)
    assert w.ranks_list[0] == 0 and int(w.ranks[0]) == 0
    assert not w.a[0].any() and not w.b[0].any()
    assert w.ranks_list[1] == 4  # the widest slice's rank
    step.set(np.array([0, 1]))
    x, y = torch.randn(2, IN), torch.randn(2, 96)
    got = y.clone()
    w.add_to(x, got)
    assert torch.equal(got[0], y[0]) and not torch.equal(got[1], y[1])


# ----- LoRAStep.groups -----------------------------------------------------------------------

def _groups(slots):
    step = LoRAStep(CPU)
    step.set(np.asarray(slots))
    return step, [(slot, t if isinstance(t, slice) else t.tolist()) for slot, t in step.groups]


def test_groups_slices_for_contiguous_tokens():
    step, groups = _groups([-1, 2, 2, 2, 0, -1])
    assert groups == [(0, slice(4, 5)), (2, slice(1, 4))]
    assert step.active
    assert step.token_slots.dtype == torch.int32
    assert step.token_slots.tolist() == [-1, 2, 2, 2, 0, -1]


def test_groups_index_tensors_otherwise():
    step, groups = _groups([1, 0, 1, -1, 1, 0, 0])
    assert groups == [(0, [1, 5, 6]), (1, [0, 2, 4])]
    for _, tokens in step.groups:
        assert tokens.dtype == torch.int64


def test_split_runs_and_the_rest():
    step = LoRAStep(CPU)
    slots = np.array([2] * 5 + [0, -1, 0] + [1] * 4 + [-1] * 6 + [1])
    step.set(slots)
    runs, rest = step.split(4)
    assert runs == [(2, slice(0, 5)), (1, slice(8, 12))]
    want = slots.copy()
    want[0:5] = want[8:12] = -1
    assert rest.dtype == torch.int32 and rest.tolist() == want.tolist()
    assert step.split(4) is step.split(4)  # built once a step
    step.set(np.array([3] * 6 + [-1]))
    runs, rest = step.split(4)
    assert runs == [(3, slice(0, 6))] and rest is None  # nothing left with an adapter
    step.set(np.array([3, 3, -1, 0]))
    runs, rest = step.split(4)
    assert runs == [] and rest.tolist() == [3, 3, -1, 0]
    # Two prompt chunks of one adapter apart: two runs.
    step.set(np.array([5] * 4 + [1] * 4 + [5] * 5))
    runs, rest = step.split(4)
    assert runs == [(5, slice(0, 4)), (1, slice(4, 8)), (5, slice(8, 13))] and rest is None


def test_groups_single_token_and_rebuilt_on_set():
    step, groups = _groups([3])
    assert groups == [(3, slice(0, 1))]
    first = step.groups
    assert step.groups is first  # built once a step
    step.set(np.array([1, -1, 1]))
    assert [(s, t.tolist()) for s, t in step.groups] == [(1, [0, 2])]
    step.clear()
    assert not step.active and step.token_slots is None
