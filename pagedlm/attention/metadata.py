"""What every attention backend is told about one engine step.

All tokens scheduled in a step are flattened into one batch with no padding.
Requests are ordered decodes first: the first `num_decodes` requests have exactly
one query token each (so the first `num_decodes` tokens are theirs), the rest are
prefills or prefill chunks with one or more query tokens.

    tokens:   | d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 |
    requests:   0    1    2    3             4
    query_start_loc = [0, 1, 2, 3, 7, 9]

The KV cache of one layer is a pair of tensors, each laid out as

    [num_blocks, block_size, num_kv_heads, head_dim]

and token `i` of request `r` lives in block `block_tables[r, i // block_size]` at
offset `i % block_size`. The flat slot of a token is `block * block_size + offset`;
`slot_mapping[t]` is the slot where the new token `t` of this step is written.
"""

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    num_decodes: int  # requests (and tokens) at the front with a single query token
    num_decode_tokens: int  # == num_decodes; kept explicit for readability at call sites
    num_prefills: int  # requests after the decodes
    num_tokens: int  # total query tokens in the step
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int64, context length incl. this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int64, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64
    # Host copies, so that backends that loop over prefills never sync with the device.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Per-step values a backend derives once and reuses in every layer.
    backend_cache: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return self.num_decodes + self.num_prefills
