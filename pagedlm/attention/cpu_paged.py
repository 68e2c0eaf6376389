"""The CPU backend: the torch backend with every decode computed by the C++ kernel.

The torch backend gathers each decode's whole context into a padded copy before SDPA,
which on a CPU costs a write and a re-read of every K/V row per layer and step; the
kernel (pagedlm/csrc/paged_attention_cpu.cpp) reads the rows in place from the cache
blocks, in one call for all decodes of the step, split over the context so that even a
single long sequence keeps every core busy. Prefills go to a second kernel
(pagedlm/csrc/prefill_attention_cpu.cpp), also one call for all of the step's, which
balances them over the threads; torch's SDPA, one call per prefill, measured half its speed
at ShareGPT lengths (benchmarks/cpu/prefill_attention.py). ALiBi and logit soft-capping
prefills stay on the torch path. `attention/reference.py` is the slow reference all are
tested against.
"""

from __future__ import annotations

import torch

from pagedlm.attention.base import AttentionOptions
from pagedlm.attention.cpu_kernels import (
    load_cpu_kernels,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_kernel_supports,
)
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.attention.torch_paged import TorchPagedAttention

_PREFILL_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                         torch.float8_e5m2)


def cpu_kernels_available() -> bool:
    return load_cpu_kernels() is not None


class CpuPagedAttention(TorchPagedAttention):
    name = "cpu"

    def __init__(self) -> None:
        if not cpu_kernels_available():
            raise ImportError("the C++ CPU attention kernels could not be built (see the log)")

    def _decodes(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, out: torch.Tensor,
                 options: AttentionOptions) -> None:
        if query.device.type != "cpu":
            super()._decodes(query, k_cache, v_cache, meta, scale, out, options)
            return
        num_decodes = meta.num_decodes
        out[:num_decodes] = paged_decode_attention(
            query[:num_decodes], k_cache, v_cache, meta.block_tables[:num_decodes],
            meta.seq_lens_cpu[:num_decodes], scale, *options,
        )

    def _prefills(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, out: torch.Tensor, options: AttentionOptions) -> None:
        alibi_slopes, sliding_window, logits_soft_cap = options
        if (query.device.type != "cpu" or alibi_slopes is not None or logits_soft_cap is not None
                or k_cache.dtype not in _PREFILL_CACHE_DTYPES
                or not prefill_kernel_supports(query.shape[-1])):
            super()._prefills(query, key, value, k_cache, v_cache, meta, scale, out, options)
            return
        first = meta.query_start_loc_cpu[meta.num_decodes]
        starts = [s - first for s in meta.query_start_loc_cpu[meta.num_decodes:]]
        out[first:] = paged_prefill_attention(
            query[first:], k_cache, v_cache, meta.block_tables[meta.num_decodes:],
            starts, meta.seq_lens_cpu[meta.num_decodes:], scale, sliding_window,
        )
