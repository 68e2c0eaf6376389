"""The engine core: scheduling, KV bookkeeping, the model step and sampling. Token ids in,
token ids out: no tokenizer and no text here, so the core can run in a process of its own.

    frontend (engine/frontend.py)                    core (this module)
    ------------------------------                   -----------------------------------
    tokenize, validate, draw seeds  -- CoreRequest -->  one Request per sample -> Scheduler
    detokenize, stop strings,       <-- CoreOutputs --  step(): schedule -> execute_model
      build RequestOutputs                                 -> update_from_output
    a stop string matched           -- finish_sequences -> blocks freed at once
    client gone                     -- abort_requests   -> blocks freed at once

A user request with n > 1 (or best_of) is several sequences, "{i}_{request_id}", that the
scheduler treats as independent requests; the frontend names them and the core tracks
which sequences are still live for each request, so an abort by user id reaches them all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from pagedlm.config import EngineArgs
from pagedlm.core.kv_cache_manager import KVCacheManager
from pagedlm.core.lora_slots import LoRASlots
from pagedlm.core.request import Request, RequestStatus
from pagedlm.core.sched_output import SchedulerOutput
from pagedlm.core.scheduler import Scheduler
from pagedlm.engine.beam_search import BeamSearchDriver, BeamSelection
from pagedlm.engine.core_io import (
    CoreBeamRequest,
    CoreInfo,
    CoreOutputs,
    CoreRequest,
    SeqOutput,
    sequence_ids,
)
from pagedlm.engine.core_sizing import (
    check_max_model_len,
    max_num_batched_tokens,
    profile_num_blocks,
    scheduler_config,
    served_max_model_len,
)
from pagedlm.engine.dashboard import DashboardSnapshot, build_snapshot
from pagedlm.engine.draft_model import make_proposer
from pagedlm.engine.lora_registry import LoRARegistry
from pagedlm.engine.stats import EngineStats, KVUsageSample, collect_stats, kv_usage_sample
from pagedlm.executor import make_executor
from pagedlm.loader.tokenizer import load_tokenizer_for
from pagedlm.structured import StructuredOutputManager
from pagedlm.worker.model_runner import ModelRunnerOutput
from pagedlm.worker.worker import model_max_len

logger = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """What the last step did, for drivers layered on the core (beam search, benchmarks)."""

    scheduled: SchedulerOutput
    result: ModelRunnerOutput
    updated: list[Request]


class EngineCore:
    """Everything between token ids in and token ids out. Not thread-safe: one thread
    (the caller's, the engine thread, or the core process's) calls it."""

    def __init__(self, args: EngineArgs, source, eos_token_ids: tuple[int, ...],
                 tokenizer=None) -> None:
        self.args = args
        self.hf_config = source.hf_config
        self.eos_token_ids = eos_token_ids
        max_len = model_max_len(self.hf_config)
        check_max_model_len(args.max_model_len, max_len)
        self.model_executor = make_executor(args, source)
        spec = self.model_executor.worker_spec()
        self.device, self.dtype = spec.device, spec.dtype
        self.spec = spec
        max_batched = max_num_batched_tokens(args, self.device.type, max_len)
        num_blocks = profile_num_blocks(self.model_executor, spec, max_batched,
                                        args.max_model_len or max_len)
        self.kv_cache_manager = KVCacheManager(num_blocks, spec.block_size,
                                               args.enable_prefix_caching, spec.sliding_window)
        self.max_model_len = served_max_model_len(args.max_model_len, self.kv_cache_manager,
                                                  max_len, max_batched, num_blocks)
        self.model_executor.initialize_cache(num_blocks, args.max_num_seqs, self.max_model_len)
        self.scheduler = Scheduler(
            scheduler_config(args, self.device.type, max_batched, self.max_model_len),
            self.kv_cache_manager,
            LoRASlots(args.max_loras) if args.enable_lora else None,
        )
        # LoRA adapters by name, read and checked against the model.
        self.loras = LoRARegistry(args.enable_lora, args.max_lora_rank,
                                  self.model_executor.check_lora)
        self.beam_search = BeamSearchDriver(eos_token_ids)
        self.proposer = make_proposer(args, self.device.type, self.hf_config.vocab_size,
                                      num_blocks, spec.block_size, self.max_model_len)

        def load_tokenizer():  # structured outputs only; the frontend's if it is here
            return tokenizer if tokenizer is not None else load_tokenizer_for(source,
                                                                              args.tokenizer)

        self.structured = StructuredOutputManager(load_tokenizer, self.hf_config.vocab_size,
                                                  eos_token_ids)
        self.info = CoreInfo(max_model_len=self.max_model_len,
                             vocab_size=self.hf_config.vocab_size, device=str(self.device),
                             num_blocks=num_blocks, block_size=spec.block_size,
                             lora_enabled=args.enable_lora)
        # user request id -> its live sequence ids; sequence id -> user request id
        self._live_seqs: dict[str, set[str]] = {}
        self._request_of: dict[str, str] = {}
        self._grammar_done: set[str] = set()
        self._num_steps = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self.kv_usage: list[KVUsageSample] = []
        self.last_step: StepRecord | None = None
        # What the dashboard reports about its own cost (engine/dashboard.py).
        self._step_seconds = 0.0
        self._snapshot_seconds = 0.0
        self._num_snapshots = 0

    # ----- requests in and out ---------------------------------------------------------------

    def add_request(self, request: CoreRequest) -> None:
        """Queue a request's sequences. With several, the first computes the prompt and
        the others fork from it when it samples its first token, sharing its blocks.
        Raises ValueError (nothing is queued) when the request can never run."""
        if request.request_id in self._live_seqs or self.beam_search.has(request.request_id):
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        seq_ids = sequence_ids(request.request_id, len(request.seeds))
        lora = None if request.lora_name is None else self.loras.get(request.lora_name)
        sequences = [
            Request(seq_id, request.prompt_token_ids, request.params, seed, self.eos_token_ids,
                    max_tokens=request.max_tokens, arrival_time=request.arrival_time,
                    cache_salt=request.cache_salt, lora=lora)
            for seq_id, seed in zip(seq_ids, request.seeds)
        ]
        structured = request.params.structured_outputs
        if structured is not None:  # compiles the grammar: a ValueError leaves nothing behind
            self.structured.add(seq_ids, structured)
        try:
            self.scheduler.add_request(sequences[0])
            if len(sequences) > 1:
                try:
                    self.scheduler.add_forked_requests(sequences[0], sequences[1:])
                except ValueError:
                    self.scheduler.finish_requests([seq_ids[0]], RequestStatus.FINISHED_ABORTED)
                    raise
        except ValueError:
            for seq_id in seq_ids:
                self.structured.remove(seq_id)
            raise
        self._live_seqs[request.request_id] = set(seq_ids)
        for seq_id in seq_ids:
            self._request_of[seq_id] = request.request_id

    def add_beam_request(self, request: CoreBeamRequest) -> None:
        if request.request_id in self._live_seqs or self.beam_search.has(request.request_id):
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        lora = None if request.lora_name is None else self.loras.get(request.lora_name)
        first_beam = self.beam_search.add(request.request_id, request.prompt_token_ids,
                                          request.params, lora)
        try:
            self.scheduler.add_request(first_beam)
        except ValueError:
            self.beam_search.abort(request.request_id)
            raise

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """End user requests (every sequence, or the beam search); their blocks go back to
        the pool now. Unknown or finished ids are ignored."""
        for request_id in request_ids:
            beam_ids = self.beam_search.abort(request_id)
            if beam_ids is not None:
                self.scheduler.finish_requests(beam_ids, RequestStatus.FINISHED_ABORTED)
                continue
            seq_ids = self._live_seqs.pop(request_id, ())
            for seq_id in seq_ids:
                del self._request_of[seq_id]
                self.structured.remove(seq_id)
                if self.proposer is not None:
                    self.proposer.forget(seq_id)
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)

    def finish_sequences(self, seq_ids: Iterable[str]) -> None:
        """Stop sequences the frontend saw finish (a stop string matched)."""
        seq_ids = list(seq_ids)
        self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_STOPPED)
        for seq_id in seq_ids:
            self._forget_sequence(seq_id)

    def _forget_sequence(self, seq_id: str) -> None:
        self.structured.remove(seq_id)
        if self.proposer is not None:
            self.proposer.forget(seq_id)
        request_id = self._request_of.pop(seq_id, None)
        if request_id is None:
            return
        live = self._live_seqs[request_id]
        live.discard(seq_id)
        if not live:
            del self._live_seqs[request_id]

    def num_waiting_sequences(self) -> int:
        """Sequences not yet scheduled: the waiting queue and the samples waiting to fork."""
        return self.scheduler.num_waiting + self.scheduler.num_pending_forks

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ----- one step --------------------------------------------------------------------------

    def step(self) -> CoreOutputs:
        start = time.perf_counter()
        try:
            return self._step()
        finally:
            self._step_seconds += time.perf_counter() - start

    def _step(self) -> CoreOutputs:
        out = CoreOutputs()
        self._grammar_done.clear()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return out
        if len(self.structured):
            sched.grammar_bitmask = self.structured.bitmask_for(self._sampling_seq_ids(sched))
        result = self.model_executor.execute_model(sched)
        if sched.grammar_bitmask is not None:
            # Done already if the worker sampled; otherwise the fill must end before the
            # matchers consume this step's tokens.
            sched.grammar_bitmask.result()
        if result.failed:  # before update_from_output, which then skips them
            out.failed = self._fail_sequences(result.failed)
        updated = self.scheduler.update_from_output(sched, result.sampled_token_ids,
                                                    result.extra_token_ids)
        if len(self.structured):
            out.failed.update(self._advance_matchers(updated))
        self.last_step = StepRecord(sched, result, updated)
        request_of = self._request_of
        out.scheduled_seq_ids = [r.req_id for r in sched.new_reqs if r.req_id in request_of]
        out.prompt_logprobs = result.prompt_logprobs
        logprobs = result.logprobs
        num_extra = self.scheduler.num_extra_tokens
        outputs = out.outputs
        for request in updated:
            seq_id = request.request_id
            if seq_id not in request_of:
                continue  # a beam: the beam-search driver reports it
            extra = num_extra.get(seq_id, 0) if num_extra else 0
            if extra:
                # One output per new token: accepted drafts (speculative decoding), then
                # the last.
                tokens = request.output_token_ids[-1 - extra:]
                lps = [logprobs.get(seq_id), *result.extra_logprobs.get(seq_id, [None] * extra)]
                for token, lp in zip(tokens[:-1], lps):
                    outputs.append(SeqOutput(seq_id, token, lp))
                seq_out = SeqOutput(seq_id, tokens[-1], lps[extra])
            else:
                seq_out = SeqOutput(seq_id, request.output_token_ids[-1],
                                    logprobs.get(seq_id) if logprobs else None)
            if request.is_finished():
                seq_out.finish_reason = request.get_finish_reason()
                seq_out.stop_reason = request.stop_reason
                seq_out.num_preemptions = request.num_preemptions
                seq_out.grammar_done = seq_id in self._grammar_done
                self._forget_sequence(seq_id)
            outputs.append(seq_out)
        if self.proposer is not None:
            if sched.spec_token_ids:
                self.proposer.record(sched.spec_token_ids, result.extra_token_ids)
            self._propose()
        if self.beam_search.has_groups():
            selections, out.beam_results = self.beam_search.on_step(self.last_step)
            for selection in selections:
                self._apply_beam_selection(selection)
        self._num_steps += 1
        self._num_prompt_tokens += sched.num_prompt_tokens
        self._num_generation_tokens += len(updated) + sum(num_extra.values())
        if self.args.record_kv_usage:
            self.kv_usage.append(kv_usage_sample(self._num_steps, self.kv_cache_manager,
                                                 self.scheduler))
        return out

    def _propose(self) -> None:
        """Drafts for the sequences that decode at the next step and may speculate: not
        beams (their tokens are chosen across the beam) and not grammar-constrained ones."""
        request_of, structured = self._request_of, self.structured
        decoding = [r for r in self.scheduler.running
                    if r.num_tokens - r.num_computed_tokens == 1 and not r.paused
                    and r.request_id in request_of and r.request_id not in structured]
        self.proposer.propose(decoding)

    def _apply_beam_selection(self, selection: BeamSelection) -> None:
        for parent, child in selection.forks:
            self.scheduler.fork_request(parent, child)
        self.scheduler.finish_requests(selection.aborted, RequestStatus.FINISHED_ABORTED)

    def _sampling_seq_ids(self, sched: SchedulerOutput) -> list[str]:
        """The sequences that sample a token at this step (a prompt's last chunk, a decode,
        the samples forked from a leader)."""
        requests = self.scheduler.requests
        ids = [rid for rid, num in sched.num_scheduled_tokens.items()
               if (r := requests.get(rid)) is not None
               and r.num_computed_tokens + num >= r.num_tokens]
        ids += [f.req_id for followers in sched.fork_reqs.values() for f in followers]
        return ids

    def _advance_matchers(self, updated: list[Request]) -> dict[str, str]:
        """Feed each constrained sequence's new token to its matcher: a finished grammar
        stops the sequence (listed in self._grammar_done for this step's outputs); a
        matcher error fails its request (returned)."""
        failed: dict[str, str] = {}
        for request in updated:
            seq_id = request.request_id
            if seq_id not in self.structured:
                continue
            done, error = self.structured.consume(seq_id, request.output_token_ids[-1])
            if error is not None:
                failed[seq_id] = error
            elif done and not request.is_finished():
                self.scheduler.finish_requests([seq_id], RequestStatus.FINISHED_STOPPED)
                self._grammar_done.add(seq_id)
        return self._fail_sequences(failed) if failed else {}

    def _fail_sequences(self, failed: dict[str, str]) -> dict[str, str]:
        """End the user requests of sequences that failed (every sample, or the whole beam
        search) and free their blocks. Returns user request id -> message."""
        by_request: dict[str, str] = {}
        for seq_id, message in failed.items():
            request_id = self._request_of.get(seq_id)
            if request_id is None:
                request_id = self.beam_search.request_of(seq_id)
            if request_id is None or request_id in by_request:
                continue
            logger.error("request %s failed: %s", request_id, message)
            self.abort_requests([request_id])
            by_request[request_id] = message
        return by_request

    # ----- state -----------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        return collect_stats(
            self.kv_cache_manager, self.scheduler, num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens, num_steps=self._num_steps,
            spec_fields=self.proposer.stats.engine_stats_fields() if self.proposer else {})

    def _owner_of(self, seq_id: str) -> tuple[str, str]:
        """A live sequence's user request id and kind: "sample" (one of n), or "beam"."""
        request_id = self._request_of.get(seq_id)
        if request_id is not None:
            return request_id, "sample"
        return self.beam_search.request_of(seq_id) or seq_id, "beam"

    def dashboard_snapshot(self, stats: EngineStats | None = None) -> DashboardSnapshot:
        """Every block's state and every live sequence, for the live dashboard (`stats`:
        this moment's, if the caller has them already)."""
        start = time.perf_counter()
        copies = list(self.last_step.scheduled.copy_blocks) if self.last_step else []
        snapshot = build_snapshot(self.kv_cache_manager, self.scheduler, copies, self._owner_of,
                                  stats or self.get_stats(), self._step_seconds)
        self._snapshot_seconds += time.perf_counter() - start
        self._num_snapshots += 1
        snapshot.build_seconds_total = self._snapshot_seconds
        snapshot.num_snapshots = self._num_snapshots
        return snapshot

    def reset_prefix_cache(self) -> None:
        self.kv_cache_manager.block_pool.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the workers (tensor-parallel ranks); the core cannot step afterwards."""
        self.model_executor.shutdown()
