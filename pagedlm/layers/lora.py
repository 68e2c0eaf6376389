"""LoRA on linear layers: every resident adapter in one stacked set of weights per layer,
each token of a batch multiplied by its own adapter's (or by none).

One adapted layer, `max_loras` slots, S slices (q / k / v of a fused QKV projection,
gate / up of a fused MLP projection, else one), rank padded to R = max_lora_rank:

    a  [max_loras, S, R, in]      slice s of slot l: A of the module feeding rows lo_s:hi_s
    b  [max_loras, R, out]        B transposed: columns lo_s:hi_s hold slice s's B^T
                                  (scale folded in)
    ranks [max_loras]             rows of a and b in use; 0: an empty slot

    y[t, lo_s:hi_s] += (a[l, s, :r] @ x[t]) @ b[l, :r, lo_s:hi_s]      l = slot of token t

The slices' output ranges are disjoint, so one `b` holds them all without the zero
blocks a block-diagonal B would multiply; transposed, so that a token's expand is r
contiguous multiply-adds over its output row rather than `out` short dot products. Tensor parallelism: a column-parallel layer keeps the
whole A and its own rows of B; a row-parallel layer keeps its own columns of A and the
whole B, and its partial delta x_r A_r^T B^T is added before the all-reduce sums the
ranks, which adds up to the full delta with no collective of its own.

Kernels, all with one signature and checked against `lora_reference`: a grouped torch
path (a GEMM pair per adapter of the step), a C++ kernel for float32 on CPU
(csrc/lora_cpu.cpp: blocks of one adapter's tokens) combined with GEMM pairs for long
prompt chunks (`lora_cpu`), and a Triton kernel for CUDA (layers/lora_triton.py). Which
one a layer uses is decided when it is built.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedlm.csrc import load_extension


class LoRAStep:
    """Which adapter slot each token of the current step uses; shared by every adapted
    layer of a model, set by the model runner before each forward."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.active = False  # any token with an adapter this step
        self.token_slots: torch.Tensor | None = None  # [num_tokens] int32, -1: none
        self._slots_np: np.ndarray | None = None
        self._groups: list[tuple[int, torch.Tensor | slice]] | None = None
        self._split: tuple | None = None

    def set(self, token_slots: np.ndarray | None) -> None:
        """`token_slots`: [num_tokens] slot per token (-1 for the base model), or None."""
        self._groups = self._split = None
        if token_slots is None or not (token_slots >= 0).any():
            self.active, self.token_slots, self._slots_np = False, None, None
            return
        self.active = True
        self._slots_np = token_slots
        self.token_slots = torch.from_numpy(token_slots.astype(np.int32)).to(self.device)

    def clear(self) -> None:
        self.set(None)

    @property
    def groups(self) -> list[tuple[int, torch.Tensor | slice]]:
        """(slot, the tokens using it) per adapter of the step: a slice where they are
        contiguous (one request's prompt chunk), else an index tensor. Built once a step."""
        if self._groups is None:
            slots = self._slots_np
            groups = []
            for slot in np.unique(slots[slots >= 0]).tolist():
                idx = np.flatnonzero(slots == slot)
                if idx[-1] - idx[0] + 1 == len(idx):
                    groups.append((slot, slice(int(idx[0]), int(idx[-1]) + 1)))
                else:
                    groups.append((slot, torch.from_numpy(idx).to(self.device)))
            self._groups = groups
        return self._groups

    def split(self, min_run: int) -> tuple[list[tuple[int, slice]], torch.Tensor | None]:
        """The step's tokens in two parts: runs of at least `min_run` consecutive tokens
        of one adapter (a long prompt chunk: a GEMM pair each, into y in place), and the
        slots of the others with those runs' tokens at -1 (None if no other token has an
        adapter)."""
        if self._split is None:
            slots = self._slots_np
            change = np.flatnonzero(np.diff(slots)) + 1
            starts = np.concatenate(([0], change))
            ends = np.concatenate((change, [len(slots)]))
            runs = [(int(slots[a]), slice(int(a), int(b))) for a, b in zip(starts, ends)
                    if slots[a] >= 0 and b - a >= min_run]
            rest = slots.copy()
            for _, tokens in runs:
                rest[tokens] = -1
            rest_t = (torch.from_numpy(rest.astype(np.int32)).to(self.device)
                      if (rest >= 0).any() else None)
            self._split = (runs, rest_t)
        return self._split


# kernel(x [T, in], y [T, out] (added to in place), weights, step)
LoRAKernel = Callable[[torch.Tensor, torch.Tensor, "LoRAWeights", LoRAStep], None]


def lora_reference(x: torch.Tensor, y: torch.Tensor, w: LoRAWeights, step: LoRAStep) -> None:
    """Token by token, in float64: the slow, obviously correct definition."""
    slots = step.token_slots.tolist()
    ranks = w.ranks.tolist()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        r = ranks[slot]
        xt = x[t].double()
        for s, (lo, hi) in enumerate(w.slices):
            h = w.a[slot, s, :r].double() @ xt  # [r]
            y[t, lo:hi] += (h @ w.b[slot, :r, lo:hi].double()).to(y.dtype)


def _grouped(x: torch.Tensor, y: torch.Tensor, w: LoRAWeights,
             groups: list[tuple[int, torch.Tensor | slice]]) -> None:
    ranks = w.ranks_list
    num_slices = len(w.slices)
    for slot, tokens in groups:
        r = ranks[slot]
        if r == 0:
            continue
        xs = x[tokens]  # [n, in]
        h = xs @ w.a[slot, :, :r].reshape(num_slices * r, -1).T  # [n, S * r]
        if isinstance(tokens, slice):
            for s, (lo, hi) in enumerate(w.slices):
                y[tokens, lo:hi].addmm_(h[:, s * r:(s + 1) * r], w.b[slot, :r, lo:hi])
        elif num_slices == 1:
            y.index_add_(0, tokens, h @ w.b[slot, :r])
        else:
            delta = torch.cat([h[:, s * r:(s + 1) * r] @ w.b[slot, :r, lo:hi]
                               for s, (lo, hi) in enumerate(w.slices)], dim=1)  # [n, out]
            y.index_add_(0, tokens, delta)


def lora_grouped(x: torch.Tensor, y: torch.Tensor, w: LoRAWeights, step: LoRAStep) -> None:
    """A GEMM pair per adapter in the step (and slice), over that adapter's tokens."""
    _grouped(x, y, w, step.groups)


# Consecutive tokens of one adapter from which a GEMM pair (MKL, in place) beats the
# token-by-token kernel: measured on SmolLM2's shapes, 2 threads, one 1024-token chunk
# 69 vs 139 ms for 30 layers; 32 chunks of 40 tokens over 4 adapters 267 (as GEMM pairs,
# one per adapter, gathered) vs 181 ms.
MIN_GEMM_RUN = 128


def lora_cpu(x: torch.Tensor, y: torch.Tensor, w: LoRAWeights, step: LoRAStep) -> None:
    """Long prompt chunks as GEMM pairs (`_grouped`), every other token through
    csrc/lora_cpu.cpp: blocks of one adapter's tokens in parallel."""
    runs, rest = step.split(MIN_GEMM_RUN)
    if rest is not None:
        w.kernels.lora_add(x, y, w.a, w.b, w.bounds, rest, w.ranks)
    if runs:
        _grouped(x, y, w, runs)


def choose_kernel(device: torch.device, dtype: torch.dtype) -> tuple[LoRAKernel, object]:
    """The fastest kernel for weights on `device` in `dtype`, and its extension module."""
    if device.type == "cuda":
        from pagedlm.layers.lora_triton import lora_triton

        return lora_triton, None
    if device.type == "cpu" and dtype == torch.float32:
        kernels = load_extension("lora_cpu")
        if kernels is not None:
            return lora_cpu, kernels
    return lora_grouped, None


class LoRAWeights:
    """A layer's adapter slots (see the module docstring for the layout)."""

    def __init__(self, in_features: int, slices: list[tuple[int, int]], max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device, step: LoRAStep,
                 kernel: LoRAKernel | None = None) -> None:
        # The slices tile the output rows in order (delta columns are concatenated so).
        assert slices[0][0] == 0 and all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
        self.slices = slices
        self.step = step
        self.a = torch.zeros(max_loras, len(slices), max_rank, in_features, dtype=dtype,
                             device=device)
        self.b = torch.zeros(max_loras, max_rank, slices[-1][1], dtype=dtype, device=device)
        self.ranks = torch.zeros(max_loras, dtype=torch.int32, device=device)
        self.ranks_list = [0] * max_loras
        self.bounds = torch.tensor(slices, dtype=torch.int64, device=device)  # [S, 2]
        if kernel is None:
            kernel, self.kernels = choose_kernel(device, dtype)
        else:
            self.kernels = load_extension("lora_cpu") if kernel is lora_cpu else None
        self.kernel = kernel

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self._set_rank(slot, 0)

    def set_slice(self, slot: int, s: int, a: torch.Tensor, b_rows: torch.Tensor) -> None:
        """Slice `s` of `slot`: a [r, in] and its rows of B [hi - lo, r] (scaled)."""
        lo, hi = self.slices[s]
        r = a.shape[0]
        assert b_rows.shape == (hi - lo, r), (b_rows.shape, (hi - lo, r))
        self.a[slot, s, :r] = a
        self.b[slot, :r, lo:hi] = b_rows.T
        self._set_rank(slot, max(self.ranks_list[slot], r))

    def _set_rank(self, slot: int, r: int) -> None:
        self.ranks_list[slot] = r
        self.ranks[slot] = r

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += the delta of each token's adapter (nothing for base-model tokens)."""
        if self.step.active:
            self.kernel(x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1]), self, self.step)
