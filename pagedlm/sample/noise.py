"""Counter-based noise for the random rows, and the torch exponential race.

A row's token depends only on its own logits, seed and step: the uniforms are a pure hash
of (seed, step, vocab index) rather than draws from a stateful generator, so batching,
row order and the device never change a sample. This torch code is the reference and the
GPU path; pagedlm/csrc/sampler_cpu.cpp fuses the same maths for CPU (see cpu_sampling.py).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _signed64(x: int) -> int:
    """Reinterpret an unsigned 64-bit constant as the int64 torch stores."""
    x &= _MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


# splitmix64 constants (Steele, Lea & Flood 2014), as signed int64.
_GOLDEN = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic (sign-extending); masking off the top `s`
    # bits turns it into the logical shift that splitmix64 is defined with.
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors. int64 multiply wraps mod 2**64, which
    is exactly the unsigned arithmetic of the reference; xor and masked shifts are
    bit-exact as well, so the results equal the unsigned algorithm bit for bit."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def random_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Deterministic uniforms in (0, 1), one per (row, vocab index).

    The hash, in unsigned 64-bit arithmetic:
        key_r   = mix64(mix64(seed_r + G) ^ step_r)
        h_{r,j} = mix64(key_r + (j + 1) * G)          (the j-th splitmix64 output
                                                       of a generator seeded with key_r)
        u_{r,j} = (top 23 bits of h_{r,j} + 0.5) / 2**23
    where G = 0x9E3779B97F4A7C15 and mix64 is splitmix64's finaliser. 23 bits keep
    every value exactly representable in float32 and strictly inside (0, 1).

    seeds: [num_rows] int64 in [0, 2**63); steps: [num_rows] int64.
    Returns [num_rows, vocab_size] float32.
    """
    bits = random_bits(seeds, steps, vocab_size)  # [num_rows, vocab], in [0, 2**23)
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def random_bits(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The 23-bit integers behind `random_uniform`: [num_rows, vocab_size] int64."""
    key = _mix64(_mix64(seeds + _GOLDEN) ^ steps)  # [num_rows]
    j = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seeds.device)  # [vocab]
    h = _mix64(key[:, None] + j * _GOLDEN)  # [num_rows, vocab]
    return _shr(h, 41)


def exponential_race(x: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Sample one token per row of x [num_rows, vocab] (scaled, masked logits) -> [num_rows].

    Gumbel-max / exponential race: argmax_j p_j / E_j with E_j = -log(u_j) ~ Exp(1) draws j
    with probability p_j. In log space that is argmax(x_j - log E_j), which needs no softmax
    and leaves -inf (masked) tokens unpickable; ties go to the lowest index.
    """
    u = random_uniform(seeds, steps, x.shape[-1])  # [num_rows, vocab]
    race = x - torch.log(-torch.log(u))  # [num_rows, vocab]
    return race.argmax(dim=-1)
