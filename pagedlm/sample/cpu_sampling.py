"""The fused C++ exponential race for CPU (pagedlm/csrc/sampler_cpu.cpp).

`noise.exponential_race` (the hash of `random_uniform`, then `x - log(-log u)` and an
argmax) stays the reference and the GPU path. On CPU it is ~20 elementwise passes over
[num_rows, vocab] int64 tensors; the kernel does hash, noise and argmax in one pass, with the
same u bit for bit. Its noise comes from a polynomial log, within ~5e-7 of the float64 value
(torch's float32 log is as close), so its pick differs from the reference's only where a row's
two best race values are that close: a tie up to float rounding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch

from pagedlm.csrc import load_extension

# (x [num_rows, vocab] float32, seeds [num_rows] int64, steps [num_rows] int64,
#  temperature [num_rows] float32 or None) -> [num_rows] int64 token ids
RaceFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def load_sampler_kernels() -> ModuleType | None:
    """The compiled sampling kernels, or None if disabled or they cannot be built."""
    return load_extension("sampler_cpu")


@functools.cache
def fused_exponential_race() -> RaceFn | None:
    """The kernel's `exponential_race`, dividing x by `temperature` first when one is given
    (bit-equal to torch's division), or None if the kernel is unavailable. Built once per
    process."""
    kernels = load_sampler_kernels()
    if kernels is None:
        return None
    race = kernels.exponential_race

    def fused(
        x: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, temperature: torch.Tensor | None
    ) -> torch.Tensor:
        return race(x.contiguous(), seeds, steps, temperature)

    return fused
