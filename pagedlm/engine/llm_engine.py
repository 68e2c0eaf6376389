"""The offline engine: a frontend and an engine core in the caller's thread.

    step():  core.step()  (schedule -> run the model -> update requests)
             -> frontend.process()  (detokenize, stop strings, RequestOutputs)
             -> core.finish_sequences(stopped by a stop string)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from pagedlm.config import EngineArgs
from pagedlm.core.kv_cache_manager import KVCacheManager
from pagedlm.core.scheduler import Scheduler
from pagedlm.engine.beam_search import BeamSearchDriver
from pagedlm.engine.core import EngineCore, StepRecord
from pagedlm.engine.core_io import CoreBeamRequest
from pagedlm.engine.frontend import EngineFrontend, eos_token_ids
from pagedlm.engine.output_processor import RequestOutputKind
from pagedlm.engine.stats import EngineStats, KVUsageSample
from pagedlm.executor import Executor
from pagedlm.loader.model_loader import resolve_model_source
from pagedlm.loader.tokenizer import load_tokenizer_for
from pagedlm.lora.adapter import LoRAAdapter
from pagedlm.lora.request import LoRARequest
from pagedlm.outputs import RequestOutput
from pagedlm.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine"]


def load_frontend_parts(args: EngineArgs):
    """The model source, its tokenizer (None with skip_tokenizer_init) and EOS ids: what
    the frontend needs before the core is built."""
    source = resolve_model_source(args.model, args.revision)
    tokenizer = None if args.skip_tokenizer_init else load_tokenizer_for(source, args.tokenizer)
    return source, tokenizer, eos_token_ids(source.hf_config, tokenizer)


class LLMEngine:
    """Requests in, one step at a time, outputs out. Everything model-side (weights, KV
    cache tensors, the forward pass, sampling) is behind `core.model_executor`."""

    def __init__(self, args: EngineArgs) -> None:
        t0 = time.perf_counter()
        self.args = args
        source, self.tokenizer, self.eos_token_ids = load_frontend_parts(args)
        self.model_path = source.path
        self.hf_config = source.hf_config
        self.core = core = EngineCore(args, source, self.eos_token_ids, self.tokenizer)
        self.frontend = EngineFrontend(self.tokenizer, core.info, args.seed)
        # The core's parts, for tools and tests that look inside: the core never replaces
        # them, so these are the same objects for the engine's life.
        self.scheduler: Scheduler = core.scheduler
        self.kv_cache_manager: KVCacheManager = core.kv_cache_manager
        self.model_executor: Executor = core.model_executor
        self.beam_search: BeamSearchDriver = core.beam_search
        self.kv_usage: list[KVUsageSample] = core.kv_usage
        self.device: torch.device = core.device
        self.dtype: torch.dtype = core.dtype
        self.max_model_len: int = core.max_model_len
        self.vocab_size: int = core.info.vocab_size
        self.load_time_s = time.perf_counter() - t0
        log_engine(core, self.model_path, self.load_time_s)

    @property
    def last_step(self) -> StepRecord | None:
        """What the core's last step did (a new record every step)."""
        return self.core.last_step

    # ----- requests -----------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        return self.frontend.tokenize(prompt)

    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                    prompt_token_ids: Sequence[int] | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request. With n > 1 (or best_of), the first sample computes the prompt
        and the others fork from it when it samples its first token, sharing its blocks.
        A `lora_request` adapter is added to the engine the first time it is named."""
        lora_name = None
        if lora_request is not None:
            lora_name = self.add_lora(lora_request).name
        request = self.frontend.make_request(request_id, prompt, params, prompt_token_ids,
                                             output_kind, arrival_time, cache_salt, lora_name)
        self._add(request)

    def add_lora(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter (ValueError naming what is wrong); known: returned."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(lora_request).__name__}")
        return self.core.loras.add(lora_request)

    def remove_lora(self, name: str) -> bool:
        return self.core.loras.remove(name)

    def add_beam_search_request(self, request_id: str, prompt_token_ids: list[int],
                                params: BeamSearchParams, prompt: str | None = None,
                                num_returned: int | None = None,
                                arrival_time: float | None = None) -> None:
        """Queue a beam search; its RequestOutput (the best `num_returned` beams, default
        all) comes out of `step()` when the search ends, with the full BeamSearchOutput in
        `output.extra["beam_search"]`."""
        self._add(self.frontend.make_beam_request(request_id, prompt_token_ids, params, prompt,
                                                  num_returned, arrival_time))

    def _add(self, request) -> None:
        try:
            if isinstance(request, CoreBeamRequest):
                self.core.add_beam_request(request)
            else:
                self.core.add_request(request)
        except BaseException:
            self.frontend.forget(request.request_id)
            raise

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.frontend.validate_prompt(prompt_token_ids, params)

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = self.frontend.abort(request_ids)
        self.core.abort_requests(request_ids)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # ----- one step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        core_out = self.core.step()
        if not core_out:
            return []
        outputs, stopped, failed = self.frontend.process(core_out)
        if stopped:
            self.core.finish_sequences(stopped)
        if failed:
            self.core.abort_requests(failed)
        return outputs

    def shutdown(self) -> None:
        """Stop the workers (tensor-parallel ranks); the engine cannot step afterwards."""
        self.core.shutdown()

    def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        return self.core.get_stats()


def log_engine(core: EngineCore, model_path, load_time_s: float) -> None:
    spec, args = core.spec, core.args
    logger.info(
        "pagedlm engine: model %s on %s (%s), %d KV blocks of %d tokens = %d tokens, "
        "max_model_len %d, attention %s, weights %s, KV cache %s, loaded in %.1f s",
        model_path, core.device, str(core.dtype).removeprefix("torch."), core.info.num_blocks,
        spec.block_size, core.kv_cache_manager.capacity_tokens, core.max_model_len,
        spec.attention_backend,
        args.weight_dtype if args.weight_dtype != "auto" else str(core.dtype).removeprefix("torch."),
        str(spec.kv_cache_dtype).removeprefix("torch."), load_time_s,
    )
