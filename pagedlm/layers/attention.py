"""The attention layer a model holds: its slice of the paged KV cache and a backend."""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.attention.metadata import AttentionMetadata

# Largest finite value of each float8 cache dtype: scaled keys and values are clamped to it
# (e5m2 would round beyond it to inf, e4m3fn has no inf).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# A calibrated scale maps the largest |K| or |V| seen to FP8_MAX / this, leaving room for
# larger values in later prompts (float8's relative precision is the same at any scale).
FP8_HEADROOM = 2.0


class Attention(nn.Module):
    """One attention layer: writes this step's K/V into its cache slice and attends.

    `sliding_window=W` lets query position i see key positions j with i - W < j <= i
    (W keys including itself, HF's convention); `logits_soft_cap=c` maps each score s
    to c * tanh(s / c) before the ALiBi bias and the mask (Gemma 2).

    A float8 cache holds K * (1 / k_scale) and V * (1 / v_scale) (per-tensor scales of this layer,
    set by `calibrate_fp8_scales`). The step's K and V are quantised here, so every backend
    attends over exactly the values the cache holds, and the scales fold into the softmax
    scale (q . k = (q . k8) * k_scale) and the output (sum p v = v_scale * sum p v8):
    backends only read float8 rows back as floats.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, backend,
                 alibi_slopes: torch.Tensor | None = None, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        if alibi_slopes is not None and alibi_slopes.shape != (num_heads,):
            raise ValueError(f"alibi_slopes has shape {tuple(alibi_slopes.shape)}, expected ({num_heads},)")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if logits_soft_cap is not None and logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap}")
        # A plain attribute, not a buffer, so that casting the model to bf16/fp16 keeps the
        # slopes in float32 (non-power-of-two head counts have slopes that are not exact in bf16).
        self.alibi_slopes = None if alibi_slopes is None else alibi_slopes.float()
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.backend = backend
        # Bound by the model runner once the cache is allocated:
        # each [num_blocks, block_size, num_kv_heads, head_dim].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # A float8 cache's scales; while `kv_amax` is a list, each step's largest |K| and
        # |V| are recorded into it (calibration).
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.kv_amax: list[float] | None = None

    # Quantising multiplies by these (a float32 product, which the C++ decoder repeats).
    @property
    def k_scale_inv(self) -> float:
        return 1.0 / self.k_scale

    @property
    def v_scale_inv(self) -> float:
        return 1.0 / self.v_scale

    @property
    def _backend_kwargs(self) -> dict:
        # Only the options that are set, so backends without them keep working for plain layers.
        kwargs: dict = {}
        if self.alibi_slopes is not None:
            kwargs["alibi_slopes"] = self.alibi_slopes
        if self.sliding_window is not None:
            kwargs["sliding_window"] = self.sliding_window
        if self.logits_soft_cap is not None:
            kwargs["logits_soft_cap"] = self.logits_soft_cap
        return kwargs

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # query [num_tokens, num_heads, head_dim]; key/value [num_tokens, num_kv_heads, head_dim]
        assert self.k_cache is not None, "KV cache not bound to the model"
        fp8_max = FP8_MAX.get(self.k_cache.dtype)
        if fp8_max is None:
            return self.backend.forward(query, key, value, self.k_cache, self.v_cache, meta,
                                        self.scale, **self._backend_kwargs)
        if self.kv_amax is not None:
            self.kv_amax[0] = max(self.kv_amax[0], float(key.abs().max()))
            self.kv_amax[1] = max(self.kv_amax[1], float(value.abs().max()))
        key8 = (key.float() * self.k_scale_inv).clamp_(-fp8_max, fp8_max).to(self.k_cache.dtype)
        value8 = (value.float() * self.v_scale_inv).clamp_(-fp8_max, fp8_max).to(self.v_cache.dtype)
        out = self.backend.forward(query, key8, value8, self.k_cache, self.v_cache, meta,
                                   self.scale * self.k_scale, **self._backend_kwargs)
        return out * self.v_scale

    def calibrate_fp8_scales(self) -> None:
        """Set k_scale and v_scale from the |K| and |V| recorded since `kv_amax` was set
        to [0.0, 0.0], and stop recording."""
        fp8_max = FP8_MAX[self.k_cache.dtype]
        k_amax, v_amax = self.kv_amax
        self.k_scale = max(k_amax, 1e-6) * FP8_HEADROOM / fp8_max
        self.v_scale = max(v_amax, 1e-6) * FP8_HEADROOM / fp8_max
        self.kv_amax = None
