"""The Triton attention backend: fused cache write, split-K decode, paged prefill.

The kernels live in `triton_kernels.py` (cache write, shared loop), `triton_decode.py`
and `triton_prefill.py`; ALiBi, sliding windows and logit soft-capping are constexpr
switches of the same kernels. This class plans each step's launches from
the host copies in the metadata (`seq_lens_cpu`, `max_query_len`), so a forward
never reads a device tensor back. Per-step plans (split count, the fp32 partial
buffers of split-K decode) are made by the first layer and reused by the others
through `meta.backend_cache`. Under CUDA graphs each captured batch size keeps one
metadata object for its graph's life (`worker/cuda_graphs.py`), so its plan and
partial buffers are static per size.
"""

import torch

from pagedlm.attention import triton_decode as td
from pagedlm.attention import triton_kernels as tk
from pagedlm.attention import triton_prefill as tp
from pagedlm.attention.base import AttentionBackend, AttentionOptions
from pagedlm.attention.metadata import AttentionMetadata

# Used for the split heuristic when the tensors are not on a GPU (the interpreter),
# so that CPU tests choose the splits an H100-class GPU would.
_DEFAULT_NUM_SMS = 132


class TritonPagedAttention(AttentionBackend):
    name = "triton"
    # Graph-safe: launches depend only on host values in the metadata, which the decode
    # graph runner keeps fixed per captured size (upper bounds), and padding rows
    # (slot -1, seq_len 0) write no K/V and get an output of 0 (see triton_kernels).
    supports_cuda_graphs = True

    def __init__(self, min_tokens_per_split: int = 256, max_splits: int = 16) -> None:
        if min_tokens_per_split < 1 or max_splits < 1:
            raise ValueError(
                f"min_tokens_per_split={min_tokens_per_split} and max_splits={max_splits} "
                "must be >= 1"
            )
        self.min_tokens_per_split = min_tokens_per_split
        self.max_splits = max_splits
        self._num_sms: dict[torch.device, int] = {}

    def _forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, options: AttentionOptions) -> torch.Tensor:
        alibi_slopes, sliding_window, logits_soft_cap = options
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = key.shape[1]
        if head_dim < 16 or head_dim & (head_dim - 1):
            raise ValueError(f"head_dim={head_dim}: the triton backend needs a power of two >= 16")
        if alibi_slopes is not None and (
            alibi_slopes.shape != (num_heads,) or alibi_slopes.dtype != torch.float32
            or alibi_slopes.stride(0) != 1
        ):
            raise ValueError(
                f"alibi_slopes must be a contiguous float32 tensor of shape ({num_heads},), "
                f"got {alibi_slopes.dtype} {tuple(alibi_slopes.shape)}"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} must be >= 1 or None")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap={logits_soft_cap} must be > 0 or None")
        kernel_options = dict(alibi_slopes=alibi_slopes, sliding_window=sliding_window,
                              logits_soft_cap=logits_soft_cap)

        tk.write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)

        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if meta.num_decodes > 0:
            num_splits, split_len, partials = self._decode_plan(
                meta, query, num_kv_heads, sliding_window
            )
            td.paged_decode_attention(
                out, query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                meta.num_decodes, scale, num_splits, split_len, partials, **kernel_options,
            )
        if meta.num_prefills > 0:
            tp.paged_prefill_attention(
                out, query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                meta.query_start_loc, meta.num_decodes, meta.num_prefills,
                meta.max_query_len, scale, **kernel_options,
            )
        return out

    def _decode_plan(
        self, meta: AttentionMetadata, query: torch.Tensor, num_kv_heads: int,
        sliding_window: int | None,
    ) -> tuple[int, int, tuple[torch.Tensor, ...] | None]:
        """(num_splits, split_len, partial buffers) for this step, made once per step
        (per window: layers with and without one, as in Gemma 2, read different spans)."""
        num_heads, head_dim = query.shape[1], query.shape[2]
        key = ("triton_decode", query.device, num_heads, num_kv_heads, head_dim, sliding_window)
        plan = meta.backend_cache.get(key)
        if plan is None:
            max_len = td.decode_span(max(meta.seq_lens_cpu[: meta.num_decodes]), sliding_window)
            num_splits = td.choose_num_splits(
                max_len, meta.num_decodes, num_kv_heads, self._sms(query.device),
                self.min_tokens_per_split, self.max_splits,
            )
            split_len = td.split_length(max_len, num_splits, td.DECODE_TILE_N)
            partials = None
            if num_splits > 1:
                partials = td.alloc_partials(
                    meta.num_decodes, num_heads, num_splits, head_dim, query.device
                )
            plan = (num_splits, split_len, partials)
            meta.backend_cache[key] = plan
        return plan

    def _sms(self, device: torch.device) -> int:
        if device not in self._num_sms:
            if device.type == "cuda":
                props = torch.cuda.get_device_properties(device)
                self._num_sms[device] = props.multi_processor_count
            else:
                self._num_sms[device] = _DEFAULT_NUM_SMS
        return self._num_sms[device]
