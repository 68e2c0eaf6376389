"""The engine: requests in, one step at a time, outputs out.

    step():  schedule  ->  run the model  ->  update requests, detokenize, publish
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pagedlm.config import EngineArgs, SchedulerConfig
from pagedlm.core.kv_cache_manager import KVCacheManager
from pagedlm.core.request import Request, RequestStatus
from pagedlm.core.sched_output import SchedulerOutput
from pagedlm.core.scheduler import Scheduler
from pagedlm.engine.beam_search import BeamSearchDriver
from pagedlm.engine.output_processor import OutputProcessor, RequestOutputKind
from pagedlm.engine.stats import EngineStats, KVUsageSample
from pagedlm.executor import Executor, MultiprocExecutor, UniProcExecutor
from pagedlm.loader.model_loader import load_tokenizer_for, resolve_model_source
from pagedlm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedlm.sampling_params import BeamSearchParams, SamplingParams
from pagedlm.worker.model_runner import ModelRunnerOutput
from pagedlm.worker.worker import model_max_len

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


def derive_seed(seed: int, index: int) -> int:
    """A well-mixed 63-bit seed for sample `index` of a request (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _eos_token_ids(hf_config, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (getattr(hf_config, "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None):
        if source is None:
            continue
        for t in source if isinstance(source, (list, tuple)) else [source]:
            if t not in ids:
                ids.append(int(t))
    return tuple(ids)


@dataclass
class StepRecord:
    """What the last step did, for drivers layered on the engine (beam search, benchmarks)."""

    scheduled: SchedulerOutput
    result: ModelRunnerOutput
    updated: list[Request]


class LLMEngine:
    """Requests in, one step at a time, outputs out. Everything model-side (weights, KV
    cache tensors, the forward pass, sampling) is behind `model_executor`."""

    def __init__(self, args: EngineArgs) -> None:
        t0 = time.perf_counter()
        self.args = args
        source = resolve_model_source(args.model)
        self.model_path = source.path
        self.hf_config = source.hf_config
        self.vocab_size = self.hf_config.vocab_size
        max_len = model_max_len(self.hf_config)
        if args.max_model_len is not None and args.max_model_len > max_len:
            raise ValueError(
                f"max_model_len ({args.max_model_len}) is larger than the model's context "
                f"({max_len} tokens)"
            )
        self.tokenizer = None
        if not args.skip_tokenizer_init:
            self.tokenizer = load_tokenizer_for(source, args.tokenizer)

        self.model_executor = self._make_executor(args, source)
        spec = self.model_executor.worker_spec()
        self.device, self.dtype = spec.device, spec.dtype
        max_batched = args.max_num_batched_tokens or (2048 if self.device.type == "cpu" else 8192)
        num_blocks = self.model_executor.determine_num_blocks(max_batched, max_len)
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget holds no block: one block of {spec.block_size} tokens "
                f"needs {spec.block_bytes} bytes; raise kv_cache_memory or gpu_memory_utilization"
            )
        self.kv_cache_manager = KVCacheManager(num_blocks, spec.block_size,
                                               args.enable_prefix_caching, spec.sliding_window)
        self.max_model_len = self._max_model_len(max_len, max_batched, num_blocks)
        self.model_executor.initialize_cache(num_blocks, args.max_num_seqs, self.max_model_len)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=args.enable_chunked_prefill,
            ),
            self.kv_cache_manager,
        )
        self.eos_token_ids = _eos_token_ids(self.hf_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._seed_rng = random.Random(args.seed)
        self._num_steps = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self.kv_usage: list[KVUsageSample] = []
        self.last_step: StepRecord | None = None
        self.beam_search = BeamSearchDriver(self.scheduler, self.eos_token_ids, self.tokenizer)
        # Beam-search requests: request id -> (prompt text, number of beams to return, arrival)
        self._beam_requests: dict[str, tuple[str | None, int, float]] = {}
        self.load_time_s = time.perf_counter() - t0
        logger.info(
            "pagedlm engine: model %s on %s (%s), %d KV blocks of %d tokens = %d tokens, "
            "max_model_len %d, attention %s, weights %s, KV cache %s, loaded in %.1f s",
            self.model_path, self.device, str(self.dtype).removeprefix("torch."), num_blocks,
            spec.block_size, self.kv_cache_manager.capacity_tokens, self.max_model_len,
            spec.attention_backend,
            args.weight_dtype if args.weight_dtype != "auto" else str(self.dtype).removeprefix("torch."),
            str(spec.kv_cache_dtype).removeprefix("torch."), self.load_time_s,
        )

    @staticmethod
    def _make_executor(args: EngineArgs, source) -> Executor:
        if args.distributed_executor_backend == "ray":
            from pagedlm.executor.ray_executor import RayExecutor  # Ray is an optional extra

            return RayExecutor(args)
        if args.tensor_parallel_size == 1:
            return UniProcExecutor(args, source)
        return MultiprocExecutor(args)

    def _max_model_len(self, model_max: int, max_batched: int, num_blocks: int) -> int:
        """The context served: max_model_len if the cache can hold it, else the model's
        context as far as the cache holds it."""
        capacity = self.kv_cache_manager.capacity_tokens
        if self.kv_cache_manager.can_ever_fit(model_max, max_batched):
            capacity = max(capacity, model_max)  # a window bounds the blocks held
        if self.args.max_model_len is None:
            return min(model_max, capacity)
        if self.args.max_model_len > capacity:
            raise ValueError(
                f"max_model_len ({self.args.max_model_len}) is larger than the KV cache can "
                f"hold ({capacity} tokens in {num_blocks} blocks); lower max_model_len or give "
                f"the cache more memory"
            )
        return self.args.max_model_len

    # ----- requests -----------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine was created with skip_tokenizer_init=True: pass "
                             "prompts as {'prompt_token_ids': [...]}")
        return self.tokenizer(prompt).input_ids

    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                    prompt_token_ids: Sequence[int] | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> None:
        """Queue a request. With n > 1 (or best_of), the first sample computes the prompt
        and the others fork from it when it samples its first token, sharing its blocks."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if self.output_processor.has_request(request_id) or request_id in self._beam_requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("a request needs a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenize(prompt)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        self._validate_prompt(prompt_token_ids, params)
        if params.use_beam_search:
            beam_params = BeamSearchParams(
                beam_width=params.best_of or params.n, max_tokens=params.max_tokens,
                ignore_eos=params.ignore_eos, temperature=params.temperature,
                length_penalty=params.length_penalty)
            self.add_beam_search_request(request_id, prompt_token_ids, beam_params, prompt=prompt,
                                         num_returned=params.n, arrival_time=arrival_time)
            return
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt_token_ids)
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        num_seqs = params.best_of or params.n
        seq_params = params
        if num_seqs > params.n and params.logprobs is None:
            # Ranking best_of samples needs each one's cumulative logprob.
            seq_params = params.clone()
            seq_params.logprobs = 0
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        sequences = []
        for i in range(num_seqs):
            seq_id = request_id if num_seqs == 1 else f"{i}_{request_id}"
            seed = base_seed if num_seqs == 1 else derive_seed(base_seed, i)
            sequences.append(Request(seq_id, prompt_token_ids, seq_params, seed, self.eos_token_ids,
                                     max_tokens=max_tokens, arrival_time=arrival,
                                     cache_salt=cache_salt))
        self.scheduler.add_request(sequences[0])
        if num_seqs > 1:
            try:
                self.scheduler.add_forked_requests(sequences[0], sequences[1:])
            except ValueError:
                self.scheduler.finish_requests([sequences[0].request_id], RequestStatus.FINISHED_ABORTED)
                raise
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, params, output_kind,
                                          sequences, arrival)

    def add_beam_search_request(self, request_id: str, prompt_token_ids: list[int],
                                params: BeamSearchParams, prompt: str | None = None,
                                num_returned: int | None = None,
                                arrival_time: float | None = None) -> None:
        """Queue a beam search; its RequestOutput (the best `num_returned` beams, default
        all) comes out of `step()` when the search ends, with the full BeamSearchOutput in
        `output.extra["beam_search"]`."""
        if self.output_processor.has_request(request_id) or request_id in self._beam_requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._validate_prompt(prompt_token_ids, SamplingParams(max_tokens=params.max_tokens))
        self.beam_search.add(request_id, prompt_token_ids, params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self._beam_requests[request_id] = (prompt, num_returned or params.beam_width, arrival)

    def _beam_output(self, request_id: str, result, finished_reason: str | None = None) -> RequestOutput:
        prompt, num_returned, arrival = self._beam_requests.pop(request_id)
        now = time.monotonic()
        completions = []
        for i, seq in enumerate(result.sequences[:num_returned] if result is not None else []):
            generated = seq.generated_token_ids
            text = ""
            if self.tokenizer is not None:
                text = self.tokenizer.decode(generated, skip_special_tokens=True)
            completions.append(CompletionOutput(
                index=i, text=text, token_ids=generated, cumulative_logprob=seq.cum_logprob,
                finish_reason=seq.finish_reason))
        if finished_reason is not None and not completions:
            completions = [CompletionOutput(index=i, text="", token_ids=[], finish_reason=finished_reason)
                           for i in range(num_returned)]
        prompt_ids = result.sequences[0].tokens[: result.sequences[0].num_prompt_tokens] \
            if result is not None and result.sequences else []
        return RequestOutput(
            request_id=request_id, prompt=prompt, prompt_token_ids=prompt_ids,
            outputs=completions, finished=True,
            metrics=RequestMetrics(arrival_time=arrival, finished_time=now),
            extra={"beam_search": result} if result is not None else {},
        )

    def _validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        num = len(prompt_token_ids)
        if num == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids contains {bad}, outside the vocabulary [0, {self.vocab_size})")
        if num >= self.max_model_len:
            raise ValueError(
                f"the prompt has {num} tokens, but the maximum context length is "
                f"{self.max_model_len} tokens (max_model_len), leaving no room to generate"
            )
        if params.max_tokens is not None and num + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {num} tokens and max_tokens is {params.max_tokens}: "
                f"{num + params.max_tokens} tokens in all, more than the maximum context length "
                f"of {self.max_model_len} tokens (max_model_len)"
            )

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for request_id in request_ids:
            if self.beam_search.abort(request_id):
                outputs.append(self._beam_output(request_id, None, finished_reason="abort"))
                continue
            seq_ids = self.output_processor.sequence_ids(request_id)
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)
            output = self.output_processor.abort(request_id)
            if output is not None:
                outputs.append(output)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ----- one step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        result = self.model_executor.execute_model(sched)
        updated = self.scheduler.update_from_output(sched, result.sampled_token_ids)
        self.last_step = StepRecord(sched, result, updated)
        outputs, stopped = self.output_processor.process(
            list(sched.num_scheduled_tokens), updated, result)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        if self.beam_search.has_groups():
            for request_id, beams in self.beam_search.on_step(self.last_step):
                outputs.append(self._beam_output(request_id, beams))
        self._num_steps += 1
        self._num_prompt_tokens += sched.num_prompt_tokens
        self._num_generation_tokens += len(updated)
        if self.args.record_kv_usage:
            self.kv_usage.append(KVUsageSample(
                step=self._num_steps,
                allocated_slots=self.kv_cache_manager.num_allocated_slots(),
                tokens_held=self._tokens_held(),
                tokens_held_unshared=self._tokens_unshared(),
                num_running=self.scheduler.num_running,
            ))
        return outputs

    def _tokens_held(self) -> int:
        """Tokens whose K/V the cache holds, a token shared by several sequences once."""
        return self.kv_cache_manager.num_distinct_tokens(self.scheduler.running)

    def _tokens_unshared(self) -> int:
        """What the live sequences would hold if nothing were shared."""
        return sum(r.num_computed_tokens for r in self.scheduler.running)

    def shutdown(self) -> None:
        """Stop the workers (tensor-parallel ranks); the engine cannot step afterwards."""
        self.model_executor.shutdown()

    def reset_prefix_cache(self) -> None:
        self.kv_cache_manager.block_pool.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        kv = self.kv_cache_manager
        return EngineStats(
            num_blocks_total=kv.num_blocks,
            num_blocks_free=kv.num_free_blocks,
            block_size=kv.block_size,
            num_tokens_held=self._tokens_held(),
            num_tokens_held_unshared=self._tokens_unshared(),
            num_blocks_shared=kv.num_shared_blocks(),
            num_block_copies=kv.num_copies,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_requests_running=self.scheduler.num_running,
            num_requests_waiting=self.scheduler.num_waiting,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            num_steps=self._num_steps,
        )
