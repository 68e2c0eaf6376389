"""Turns a SchedulerOutput into tensors, runs the model and samples.

Step inputs are built with vectorised numpy over the scheduled requests: no Python loop
over tokens or blocks. Requests are ordered decodes first (one query token each), then
prefill chunks, which is the layout `AttentionMetadata` describes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.core.request import Request
from pagedlm.core.scheduler import ScheduledRequest, SchedulerOutput
from pagedlm.sample.sampler import (
    Sampler,
    SamplingRequestState,
    compute_logprobs,
    make_sampling_batch,
)
from pagedlm.worker.cuda_graphs import DecodeGraphRunner


@dataclass
class TokenLogprobs:
    """Logprob data of one position: the chosen token and the top-k alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # request id -> [(position of the predicted prompt token, its logprobs)]
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = field(default_factory=dict)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    order: list[ScheduledRequest]  # requests in batch order (decodes first)
    logits_indices: torch.Tensor  # [num_sampled] token index of each sampled row's last token
    # The request behind each sampled row: a request that reached its last token, then
    # each sample forked from it at this step (same logits row, its own seed).
    sampled: list[Request]
    # Prompt-logprob requests: (request, token indices into the batch, target prompt token ids)
    prompt_logprob_rows: list[tuple[ScheduledRequest, np.ndarray, np.ndarray]]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, block_size: int,
                 vocab_size: int) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.sampler = Sampler()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.decode_graphs: DecodeGraphRunner | None = None
        # Step inputs go to a GPU through pinned host memory, asynchronously (the caching
        # host allocator keeps each pinned block alive until its copy has run); on CPU
        # they are used in place.
        if device.type == "cuda":
            self._upload = lambda a: torch.from_numpy(a).pin_memory().to(device, non_blocking=True)
        else:
            self._upload = torch.from_numpy
        self._forward = self._forward_eager
        self.cpu_decoder = None  # models/llama_cpu_decode.py, where enabled

    def enable_cpu_decoder(self) -> str:
        """Run pure-decode steps through the C++ decoder of models/llama_cpu_decode.py where
        the model qualifies (call after `bind_kv_cache`). Returns what was done, for the log."""
        from pagedlm.models.llama_cpu_decode import LlamaCpuDecoder

        self.cpu_decoder, what = LlamaCpuDecoder.build(self.model)
        if self.cpu_decoder is None:
            if self._forward == self._forward_cpu_decoder:
                self._forward = self._forward_eager
            return f"off ({what})"
        self._forward = self._forward_cpu_decoder
        return f"on ({what})"

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool) -> None:
        """Run pure-decode steps padded through static buffers, replaying CUDA graphs if
        `capture` (CUDA only; call after `bind_kv_cache`: graphs hold the cache addresses).
        Without capture the same padded path runs eagerly, which is what CPU tests check."""
        self.decode_graphs = DecodeGraphRunner(self.model, self.device, max_num_seqs,
                                               max_model_len, self.block_size, capture)
        self._forward = self._forward_padded

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        layers = self.model.attention_layers()
        assert len(layers) == len(kv_caches)
        for layer, (k_cache, v_cache) in zip(layers, kv_caches):
            layer.k_cache, layer.v_cache = k_cache, v_cache
        self.kv_caches = kv_caches
        if self.cpu_decoder is not None:  # it holds the caches it writes
            self.enable_cpu_decoder()

    # ----- inputs -----------------------------------------------------------------------

    def prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        # Decodes first, longest context first (the attention backend buckets decodes by
        # length), then prefill chunks.
        order = sorted(
            sched.scheduled,
            key=lambda s: (s.num_new_tokens != 1, -s.num_computed_tokens if s.num_new_tokens == 1 else 0),
        )
        num_reqs = len(order)
        num_decodes = sum(1 for s in order if s.num_new_tokens == 1)
        q_lens = np.fromiter((s.num_new_tokens for s in order), dtype=np.int64, count=num_reqs)
        starts = np.fromiter((s.num_computed_tokens for s in order), dtype=np.int64, count=num_reqs)
        seq_lens = starts + q_lens
        cu = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        num_tokens = int(cu[-1])

        tokens: list[int] = []
        for s in order:
            all_ids = s.request.all_token_ids
            if s.num_new_tokens == 1:
                tokens.append(all_ids[s.num_computed_tokens])
            else:
                tokens.extend(all_ids[s.num_computed_tokens : s.num_computed_tokens + s.num_new_tokens])
        input_ids = np.array(tokens, dtype=np.int64)

        req_of_token = np.repeat(np.arange(num_reqs), q_lens)  # [num_tokens]
        positions = np.arange(num_tokens, dtype=np.int64) - cu[req_of_token] + starts[req_of_token]

        max_blocks = max(len(s.block_ids) for s in order)
        block_tables = np.zeros((num_reqs, max_blocks), dtype=np.int64)
        for i, s in enumerate(order):
            block_tables[i, : len(s.block_ids)] = s.block_ids
        slot_mapping = (
            block_tables[req_of_token, positions // self.block_size] * self.block_size
            + positions % self.block_size
        )

        sampled: list[Request] = []
        rows: list[int] = []
        for i, s in enumerate(order):
            if s.sample:
                for request in [s.request, *s.forks]:
                    sampled.append(request)
                    rows.append(int(cu[i + 1]) - 1)
        logits_indices = np.array(rows, dtype=np.int64)

        prompt_rows = []
        for i, s in enumerate(order):
            request = s.request
            if request.sampling_params.prompt_logprobs is None:
                continue
            # Position p predicts prompt token p + 1; only positions inside the prompt count.
            first = s.num_computed_tokens
            last = min(first + s.num_new_tokens, request.num_prompt_tokens - 1)
            if last <= first:
                continue
            idx = np.arange(cu[i], cu[i] + (last - first), dtype=np.int64)
            targets = np.array(request.prompt_token_ids[first + 1 : last + 1], dtype=np.int64)
            prompt_rows.append((s, idx, targets))

        up = self._upload
        meta = AttentionMetadata(
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            num_prefills=num_reqs - num_decodes,
            num_tokens=num_tokens,
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=up(cu),
            seq_lens=up(seq_lens),
            block_tables=up(block_tables),
            slot_mapping=up(slot_mapping),
            query_start_loc_cpu=cu.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        return StepInputs(
            input_ids=up(input_ids),
            positions=up(positions),
            meta=meta,
            order=order,
            logits_indices=up(logits_indices),
            sampled=sampled,
            prompt_logprob_rows=prompt_rows,
        )

    # ----- one step ---------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if sched.copy_blocks:
            self.copy_blocks(sched.copy_blocks)
        inputs = self.prepare_inputs(sched)
        hidden = self._forward(inputs)  # [num_tokens, hidden]
        out = ModelRunnerOutput()
        if inputs.prompt_logprob_rows:
            self._prompt_logprobs(hidden, inputs, out)
        if not inputs.sampled:
            return out
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [num_sampled, vocab]
        states = [
            SamplingRequestState(
                params=r.sampling_params,
                seed=r.seed,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                eos_token_ids=r.eos_token_ids,
            )
            for r in inputs.sampled
        ]
        batch = make_sampling_batch(states, logits.shape[-1], logits.device)
        result = self.sampler(logits, batch)
        token_ids = result.sampled_token_ids.tolist()
        for r, token_id in zip(inputs.sampled, token_ids):
            out.sampled_token_ids[r.request_id] = token_id
        if result.sampled_logprobs is not None:
            lps = result.sampled_logprobs.tolist()
            ranks = result.sampled_ranks.tolist()
            top_ids = result.topk_token_ids.tolist()
            top_lps = result.topk_logprobs.tolist()
            for i, r in enumerate(inputs.sampled):
                num_top = r.sampling_params.logprobs
                if num_top is None:
                    continue
                out.logprobs[r.request_id] = TokenLogprobs(
                    token_ids[i], lps[i], ranks[i], top_ids[i][:num_top], top_lps[i][:num_top]
                )
        return out

    def _forward_eager(self, inputs: StepInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, inputs.meta)  # [num_tokens, hidden]

    def _forward_cpu_decoder(self, inputs: StepInputs) -> torch.Tensor:
        if inputs.meta.num_prefills == 0:
            return self.cpu_decoder(inputs.input_ids, inputs.positions, inputs.meta)
        return self._forward_eager(inputs)

    def _forward_padded(self, inputs: StepInputs) -> torch.Tensor:
        # Prompt logprobs only come with prefill tokens, so a pure-decode step has none.
        if self.decode_graphs.can_run(inputs.meta):
            return self.decode_graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        return self._forward_eager(inputs)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src -> block dst in every layer's K and V cache."""
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: StepInputs, out: ModelRunnerOutput) -> None:
        for s, idx, targets in inputs.prompt_logprob_rows:
            num_top = s.request.sampling_params.prompt_logprobs
            logits = self.model.compute_logits(hidden[torch.from_numpy(idx).to(self.device)])
            lp, rank, top_ids, top_lps = compute_logprobs(
                logits, torch.from_numpy(targets).to(self.device), num_top
            )
            lp, rank, top_ids, top_lps = lp.tolist(), rank.tolist(), top_ids.tolist(), top_lps.tolist()
            first_pos = s.num_computed_tokens + 1
            out.prompt_logprobs[s.request_id] = [
                (first_pos + j, TokenLogprobs(int(targets[j]), lp[j], rank[j], top_ids[j], top_lps[j]))
                for j in range(len(targets))
            ]
