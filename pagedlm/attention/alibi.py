"""ALiBi slopes (Press et al., "Train Short, Test Long", 2021).

Head h of n heads (n a power of two) gets slope 2^(-8 (h + 1) / n): a geometric
sequence from 2^(-8/n) down to 2^-8. For other n, with p the largest power of two
below n, the first p heads take the p-head slopes and the remaining n - p heads take
every other slope of the 2p-head sequence (its odd powers 1, 3, 5, ...), so the
extra slopes interleave with the first ones instead of repeating them.
"""

import math

import torch


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """[num_heads] float32 ALiBi slopes for all heads of a model (slice them per rank)."""
    if num_heads < 1:
        raise ValueError(f"num_heads must be positive, got {num_heads}")
    closest = 2 ** math.floor(math.log2(num_heads))
    powers = torch.arange(1, closest + 1, dtype=torch.float64)  # [closest]
    slopes = 2.0 ** (-8.0 * powers / closest)
    if closest != num_heads:
        extra_powers = torch.arange(1, 2 * (num_heads - closest), 2, dtype=torch.float64)
        slopes = torch.cat([slopes, 2.0 ** (-8.0 * extra_powers / (2 * closest))])
    return slopes.float()  # [num_heads]
