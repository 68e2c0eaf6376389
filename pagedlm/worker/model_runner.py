"""Turns a SchedulerOutput into tensors, runs the model and samples.

Each step: apply the SchedulerOutput to the persistent batch (input_batch.py), gather the
step's inputs from it (step_inputs.py), run the forward (eager, CUDA graphs or the C++
decoder: `_forward`, picked when one is enabled), then sample the rows that reached their
last token, verify speculative drafts and compute the logprobs asked for.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from pagedlm.core.sched_output import SchedulerOutput
from pagedlm.layers.lora import MIN_GEMM_RUN
from pagedlm.models.llama_cpu_decode import LlamaCpuDecoder
from pagedlm.sample.ops import compute_logprobs
from pagedlm.sample.sampler import Sampler
from pagedlm.structured import apply_bitmask
from pagedlm.worker.cuda_graphs import DecodeGraphRunner
from pagedlm.worker.input_batch import InputBatch
from pagedlm.worker.lora_model import LoRAModel
from pagedlm.worker.step_inputs import StepInputs, prepare_inputs

logger = logging.getLogger(__name__)


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
    # Speculative decoding: request id -> its accepted drafts (the tokens it gets after
    # the first, each the token sampled at its position), and their logprobs.
    extra_token_ids: dict[str, list[int]] = field(default_factory=dict)
    extra_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request id -> [(position of the predicted prompt token, its logprobs)]
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = field(default_factory=dict)
    # request id -> why it could not be sampled (its own fault; the others were sampled)
    failed: dict[str, str] = field(default_factory=dict)


NONFINITE_LOGITS = "the model produced non-finite logits (NaN or inf) for this request"


def nonfinite_rows(logits: torch.Tensor) -> list[int]:
    """Rows that cannot be sampled: NaN or +inf anywhere (max propagates NaN), or no
    finite logit at all. One reduction over the logits. The sampler finds the same rows
    at almost no cost (SamplerOutput.sampled_logits); this reduction is for the rows a
    grammar is about to mask, and the sampler's reference in tests."""
    finite = torch.isfinite(logits.amax(dim=-1))
    if bool(finite.all()):  # the usual case, without nonzero()'s index tensor and list
        return []
    return (~finite).nonzero().flatten().tolist()


def _sampled_lists(result) -> tuple:
    """A SamplerOutput as Python lists: token ids, the rows that could not be sampled (their
    logits were not finite), then (None when no row asked for logprobs) sampled logprobs,
    ranks, top ids, top logprobs."""
    token_ids = result.sampled_token_ids.tolist()
    picked = result.sampled_logits.tolist()
    # float32 values summed in float64 cannot overflow: the sum is finite exactly when
    # every value is, and the rows are only looked at one by one when some is not.
    bad = [] if math.isfinite(sum(picked)) else [
        i for i, v in enumerate(picked) if not math.isfinite(v)]
    if result.sampled_logprobs is None:
        return token_ids, bad, None, None, None, None
    return (token_ids, bad, result.sampled_logprobs.tolist(), result.sampled_ranks.tolist(),
            result.topk_token_ids.tolist(), result.topk_logprobs.tolist())


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, block_size: int,
                 vocab_size: int, is_driver: bool = True) -> None:
        """`is_driver`: this runner's results are the step's. Other tensor-parallel ranks run
        the same forward and LM head (their collectives must match) but sample nothing: the
        scheduler sends every rank the sampled tokens with the next step."""
        self.is_driver = is_driver
        self.model = model
        self.device = device
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.sampler = Sampler()
        self.input_batch = InputBatch(vocab_size)
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
        self.lora: LoRAModel | None = None  # adapter slots (worker/lora_model.py), if enabled
        self._kept: list = []  # the last step's inputs and results (see _execute_model)

    def enable_cpu_decoder(self) -> str:
        """Run the steps it takes (`LlamaCpuDecoder.takes`) through the C++ decoder of
        models/llama_cpu_decode.py where the model qualifies (call after `bind_kv_cache`).
        Returns what was done, for the log."""
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
        """The step's tensors, gathered from the persistent batch (after `update`)."""
        return prepare_inputs(self.input_batch, sched, self.block_size, self._upload)

    # ----- one step ---------------------------------------------------------------------

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One step, in inference mode. The loops that step the engine over and over (the
        offline `LLM`, the engine core's loop, a worker process) hold inference mode
        around the whole loop: entering it here for each step costs tens of microseconds
        once the forward has evicted torch's Python-facing code from the caches."""
        if torch.is_inference_mode_enabled():
            return self._execute_model(sched)
        with torch.inference_mode():
            return self._execute_model(sched)

    def _execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.input_batch.update(sched)
        if sched.copy_blocks:
            self.copy_blocks(sched.copy_blocks)
        for slot, adapter in sched.lora_loads.items():
            self.lora.load(slot, adapter)
        inputs = self.prepare_inputs(sched)
        # The sampling tensors depend on the batch alone, so they are gathered here, before
        # the forward: afterwards, with the weights streamed through the caches, the same
        # numpy and torch calls cost several times as much (benchmarks/cpu/step_host_time.py).
        batch = batch_error = None
        if inputs.sampled_req_ids and self.is_driver:
            try:
                batch = self.input_batch.sampling_batch(inputs.sampled_rows, self.device,
                                                        inputs.sampled_extra)
            except Exception as e:  # sampled apart below, each request's own fault
                batch_error = e
        # The step before's inputs and results are let go here, while the code that frees
        # them is still in the caches; at the end of the step it cost about 30 us more.
        # (Not its logits: this step's LM head reuses their memory.)
        self._kept = [inputs, batch]
        if self.lora is not None:
            step = self.lora.step
            step.set(inputs.lora_slots)
            # CUDA graphs know nothing of adapters. The C++ decoder applies them token by
            # token: a step with prompt chunks and a long run of one adapter's tokens, which
            # the Python layers multiply as a GEMM pair, is theirs (layers/lora.py
            # MIN_GEMM_RUN); pure-decode steps always stay in the decoder.
            forward = self._forward
            if step.active and (self.cpu_decoder is None or (
                    inputs.meta.num_prefills and step.split(MIN_GEMM_RUN)[0])):
                forward = self._forward_eager
            hidden = forward(inputs)  # [num_tokens, hidden]
        else:
            hidden = self._forward(inputs)  # [num_tokens, hidden]
        out = ModelRunnerOutput()
        if inputs.prompt_logprob_rows:
            self._prompt_logprobs(hidden, inputs, out)
        if not inputs.sampled_req_ids:
            return out
        if not inputs.every_token_sampled:
            hidden = hidden[inputs.logits_indices]  # [num_sampled, hidden]
        logits = self.model.compute_logits(hidden)  # [num_sampled, vocab]
        if not self.is_driver:
            return out
        req_ids = inputs.sampled_req_ids
        if sched.grammar_bitmask is not None:
            # The grammar's -inf would hide the model's NaN or +inf from the sampler's
            # check: these rows are checked before it.
            bad = nonfinite_rows(logits)
            if bad:
                for i in bad:
                    out.failed[req_ids[i]] = NONFINITE_LOGITS
                logits = logits.clone()
                logits[bad] = 0.0  # sampled as usual, then discarded
            self._apply_grammar(logits, req_ids, sched.grammar_bitmask)
        try:
            if batch_error is not None:
                raise batch_error
            sampled = self.sampler(logits, batch)
            self._kept += (hidden, sampled)
            rows = _sampled_lists(sampled)
        except Exception:
            logger.exception("sampling the batch failed: sampling each request apart")
            rows = self._sample_apart(logits, inputs, out)
        token_ids, bad, lps, ranks, top_ids, top_lps = rows
        for i in bad:  # the sampler's check of the logits (SamplerOutput.sampled_logits)
            out.failed.setdefault(req_ids[i], NONFINITE_LOGITS)  # its token is discarded
        logprobs: list[TokenLogprobs | None] | None = None
        if lps is not None:
            num_logprobs = self.input_batch.num_logprobs[inputs.sampled_rows].tolist()
            logprobs = [None if num_logprobs[i] < 0 or lps[i] is None else TokenLogprobs(
                token_ids[i], lps[i], ranks[i], top_ids[i][:num_logprobs[i]],
                top_lps[i][:num_logprobs[i]]) for i in range(len(req_ids))]
        if sched.spec_token_ids:
            self._verify(sched.spec_token_ids, req_ids, token_ids, logprobs, out)
            return out
        out.sampled_token_ids = dict(zip(req_ids, token_ids))
        if logprobs is not None:
            out.logprobs = {r: lp for r, lp in zip(req_ids, logprobs) if lp is not None}
        return out

    @staticmethod
    def _verify(spec: dict[str, list[int]], req_ids: list[str], token_ids: list[int],
                logprobs: list[TokenLogprobs | None] | None, out: ModelRunnerOutput) -> None:
        """Accept drafts. A request verifying k drafts has k + 1 consecutive rows, row j
        sampled as if drafts 0..j-1 had been generated (its own noise step, penalties).
        Draft j is accepted while the token sampled at its position equals it: the output
        is then exactly the tokens decoding one by one would have sampled (for a proposal
        that is one token, this is Leviathan et al.'s rejection rule: accepted with
        probability p(draft), else a token drawn from p without the draft)."""
        i = 0
        while i < len(req_ids):
            req_id = req_ids[i]
            drafts = spec.get(req_id, ())
            n = len(drafts)
            out.sampled_token_ids[req_id] = token_ids[i]
            accepted = 0
            while accepted < n and token_ids[i + accepted] == drafts[accepted]:
                accepted += 1
            if accepted:
                out.extra_token_ids[req_id] = token_ids[i + 1:i + 1 + accepted]
            if logprobs is not None and logprobs[i] is not None:
                out.logprobs[req_id] = logprobs[i]
                if accepted:
                    out.extra_logprobs[req_id] = logprobs[i + 1:i + 1 + accepted]
            i += n + 1

    @staticmethod
    def _apply_grammar(logits: torch.Tensor, req_ids: list[str], pending) -> None:
        """Structured outputs: tokens the grammar forbids get -inf (waits for the masks,
        which were filled while the forward ran)."""
        bitmask = pending.result()
        pairs = [(i, pending.rows[r]) for i, r in enumerate(req_ids) if r in pending.rows]
        if not pairs:
            return
        rows = torch.tensor([i for i, _ in pairs], device=logits.device)
        apply_bitmask(logits, rows, bitmask[torch.tensor([j for _, j in pairs])])

    def _sample_apart(self, logits: torch.Tensor, inputs: StepInputs,
                      out: ModelRunnerOutput) -> tuple:
        """Sample row by row, so that a request whose parameters break the sampler fails
        alone (recorded in out.failed) while the others get their tokens."""
        token_ids, bad, lps, ranks, top_ids, top_lps = [], [], [], [], [], []
        for i, req_id in enumerate(inputs.sampled_req_ids):
            try:
                extra = (None if inputs.sampled_extra is None
                         else inputs.sampled_extra[i:i + 1])
                batch = self.input_batch.sampling_batch(inputs.sampled_rows[i:i + 1],
                                                        logits.device, extra)
                row = _sampled_lists(self.sampler(logits[i:i + 1], batch))
            except Exception as e:
                logger.exception("sampling request %s failed", req_id)
                out.failed[req_id] = f"sampling failed for this request ({type(e).__name__}: {e})"
                row = ([0], [], None, None, None, None)
            token_ids.append(row[0][0])
            if row[1]:
                bad.append(i)
            for column, values in zip((lps, ranks, top_ids, top_lps), row[2:]):
                column.append(values[0] if values is not None else None)
        return token_ids, bad, lps, ranks, top_ids, top_lps

    def _forward_eager(self, inputs: StepInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, inputs.meta)  # [num_tokens, hidden]

    def _forward_cpu_decoder(self, inputs: StepInputs) -> torch.Tensor:
        if self.cpu_decoder.takes(inputs.meta):
            slots = self.lora.step.token_slots if self.lora is not None else None
            return self.cpu_decoder(inputs.input_ids, inputs.positions, inputs.meta, slots)
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
        batch = self.input_batch
        for req_id, first_pos, idx, targets in inputs.prompt_logprob_rows:
            num_top = int(batch.num_prompt_logprobs[batch.row_of[req_id]])
            logits = self.model.compute_logits(hidden[torch.from_numpy(idx).to(self.device)])
            if not self.is_driver:
                continue
            lp, rank, top_ids, top_lps = compute_logprobs(
                logits, torch.from_numpy(targets).to(self.device), num_top
            )
            lp, rank, top_ids, top_lps = lp.tolist(), rank.tolist(), top_ids.tolist(), top_lps.tolist()
            out.prompt_logprobs[req_id] = [
                (first_pos + j, TokenLogprobs(int(targets[j]), lp[j], rank[j], top_ids[j], top_lps[j]))
                for j in range(len(targets))
            ]
