"""Pick an attention backend by name.

Every backend has the same call:

    backend.forward(query, key, value, k_cache, v_cache, meta, scale, *, alibi_slopes=None,
                    sliding_window=None, logits_soft_cap=None) -> output
    # query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads, head_dim],
    # caches [num_blocks, block_size, num_kv_heads, head_dim]; output like query.

It writes this step's key/value into the cache at `meta.slot_mapping` first, then
attends causally over each request's context read from the paged cache.

`alibi_slopes` ([num_heads] float32) adds the ALiBi bias `slope_h * (j - i)` to the
score of query position i against key position j (0 on the diagonal, negative
behind it). Softmax is shift-invariant per row, so this equals HF BLOOM's
`slope_h * j`; the relative form keeps the bias small on long contexts.

The score of query position i against key position j is, in this order:

    s = (q_i . k_j) * scale
    s = cap * tanh(s / cap)              if logits_soft_cap   (Gemma 2; before the bias)
    s = s + slope_h * (j - i)            if alibi_slopes
    s = -inf unless j <= i and (sliding_window is None or i - j < sliding_window)

so a window W shows each query W keys, itself included. That is HF transformers'
convention (checked against transformers 5.23 masking_utils.sliding_window_overlay:
`kv_idx > q_idx - sliding_window`, used by Mistral, Qwen2, Gemma 2/3). Key blocks
that lie wholly before i - W + 1 are never read through the mask, which is what lets
the KV cache manager free them.
"""

from collections.abc import Callable
from typing import Protocol

import torch

from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.attention.reference import ReferenceAttention
from pagedlm.attention.torch_paged import TorchPagedAttention


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        alibi_slopes: torch.Tensor | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor: ...


_BACKENDS: dict[str, type] = {
    "torch": TorchPagedAttention,
    "reference": ReferenceAttention,
}


def _load_triton() -> type:
    from pagedlm.attention.triton_backend import TritonPagedAttention

    return TritonPagedAttention


def _load_cpu() -> type:
    from pagedlm.attention.cpu_paged import CpuPagedAttention

    return CpuPagedAttention


# Imported on first use, so that installs without their optional package (or, for "cpu",
# without a C++ compiler) still work.
_LAZY_BACKENDS: dict[str, Callable[[], type]] = {"triton": _load_triton, "cpu": _load_cpu}


def resolve_backend_name(name: str, device_type: str) -> str:
    """ "auto": the C++ kernels on CPU when they build (else "torch"); "torch" on GPUs."""
    if name != "auto":
        return name
    if device_type == "cpu":
        from pagedlm.attention.cpu_paged import cpu_kernels_available

        return "cpu" if cpu_kernels_available() else "torch"
    return "torch"


def get_attention_backend(name: str = "torch") -> AttentionBackend:
    """Return a new instance of the backend called `name` ("torch", "reference", "triton",
    "cpu")."""
    if name in _LAZY_BACKENDS:
        try:
            cls = _LAZY_BACKENDS[name]()
        except ImportError as e:
            raise ImportError(f"attention backend {name!r} needs a missing package: {e}") from e
        return cls()
    try:
        cls = _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of "
            f"{sorted([*_BACKENDS, *_LAZY_BACKENDS])}"
        ) from None
    return cls()
