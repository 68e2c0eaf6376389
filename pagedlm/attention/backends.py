"""Pick an attention backend by name.

Every backend has the same call:

    backend.forward(query, key, value, k_cache, v_cache, meta, scale) -> output
    # query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads, head_dim],
    # caches [num_blocks, block_size, num_kv_heads, head_dim]; output like query.

It writes this step's key/value into the cache at `meta.slot_mapping` first, then
attends causally over each request's context read from the paged cache.
"""

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
    ) -> torch.Tensor: ...


_BACKENDS: dict[str, type] = {
    "torch": TorchPagedAttention,
    "reference": ReferenceAttention,
}


def get_attention_backend(name: str = "torch") -> AttentionBackend:
    """Return a new instance of the backend called `name` ("torch" or "reference")."""
    try:
        cls = _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {sorted(_BACKENDS)}"
        ) from None
    return cls()
