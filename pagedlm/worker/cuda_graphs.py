"""CUDA graphs for pure-decode steps: a batch is padded up to a captured size and replayed.

A decode step of n requests has n query tokens. It runs through persistent static
buffers sized for the largest captured batch; a step is padded up to the next captured
size `b >= n`, and rows n..b-1 are padding that must be harmless:

    row        0    1    2  |  3 (padding)
    input_ids  t0   t1   t2 |  stale (any valid id)
    positions  p0   p1   p2 |  stale (any valid position)
    slot       s0   s1   s2 |  -1     -> the backend writes no K/V
    seq_len    l0   l1   l2 |  0      -> the backend attends to nothing, output 0

Every captured size uses views of the same buffers (same addresses at every replay)
and its own `AttentionMetadata`, kept for the life of the runner, so whatever the
backend plans per step and caches in `meta.backend_cache` (the Triton backend's split
count and fp32 partial buffers) is made once per size and baked into the graph. The
host copies in that metadata are upper bounds, not this step's values: every context
is planned as `max_model_len` long, so one plan covers any step the graph replays.

The same padded path runs without capture (`capture=False`): that is how CPU tests
check that padding changes no real row.
"""

from __future__ import annotations

import torch

from pagedlm.attention.metadata import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8 up to max_num_seqs
    (and max_num_seqs itself), so that padding wastes at most 7 rows past 8."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += range(8, max_num_seqs + 1, 8)
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def padded_size(sizes: list[int], num_reqs: int) -> int | None:
    """The smallest captured size that holds num_reqs rows; None if none does."""
    for size in sizes:
        if size >= num_reqs:
            return size
    return None


class DecodeGraphRunner:
    """Runs pure-decode steps through static, padded inputs; replays CUDA graphs if captured."""

    def __init__(self, model: torch.nn.Module, device: torch.device, max_num_seqs: int,
                 max_model_len: int, block_size: int, capture: bool) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model = model
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.max_num_blocks = -(-max_model_len // block_size)
        max_bs = self.sizes[-1]
        kw = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_bs, **kw)  # [max_bs]
        self.positions = torch.zeros(max_bs, **kw)  # [max_bs]
        self.slot_mapping = torch.full((max_bs,), -1, **kw)  # [max_bs]
        self.seq_lens = torch.zeros(max_bs, **kw)  # [max_bs]
        self.block_tables = torch.zeros((max_bs, self.max_num_blocks), **kw)
        self.query_start_loc = torch.arange(max_bs + 1, **kw)  # one query token per row
        self.metas = {b: self._static_meta(b) for b in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [b, hidden] written by each replay
        self.num_steps = 0  # steps run through the padded path
        self.num_padding_rows = 0
        if capture:
            self._capture_all()

    def _static_meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_decodes=b, num_decode_tokens=b, num_prefills=0, num_tokens=b,
            max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            slot_mapping=self.slot_mapping[:b],
            query_start_loc_cpu=list(range(b + 1)),
            seq_lens_cpu=[self.max_model_len] * b,  # planning bound, see the module doc
        )

    def can_run(self, meta: AttentionMetadata) -> bool:
        """A pure-decode step that fits the largest size and the static block table."""
        return (
            meta.num_prefills == 0
            and meta.num_decodes <= self.sizes[-1]
            and meta.block_tables.shape[1] <= self.max_num_blocks
            and meta.max_seq_len <= self.max_model_len
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of the step's n decode tokens, through the padded path."""
        n = meta.num_decodes
        b = padded_size(self.sizes, n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if b > n:
            # Padding rows: no cache write, no context. Their block-table rows, ids and
            # positions may be stale from an earlier step: nothing reads them.
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(0)
        self.num_steps += 1
        self.num_padding_rows += b - n
        graph = self.graphs.get(b)
        if graph is None:
            hidden = self._forward(b)
        else:
            graph.replay()
            hidden = self.outputs[b]
        return hidden[:n]  # [n, hidden]

    def _forward(self, b: int) -> torch.Tensor:
        return self.model(self.input_ids[:b], self.positions[:b], self.metas[b])  # [b, hidden]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # All rows are padding while capturing (slot -1, seq_len 0): the warm-up runs
        # write no K/V and read none. Largest first, sharing one memory pool: each
        # graph's temporaries can reuse what the larger ones left in the pool.
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(0)
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            self._forward(b)  # warm-up: Triton compiles, the backend makes its plan
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
