"""The frontend half of the engine: user requests to CoreRequests, CoreOutputs to
RequestOutputs. It holds the tokenizer and every piece of per-request text state
(incremental detokenizers, stop strings, logprob texts); the core holds none.

The offline `LLMEngine` drives a frontend and a core in one thread; the server's
`AsyncLLMEngine` drives a frontend on the event loop and a core in another process.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Sequence

from pagedlm.engine.core_io import (
    CoreBeamRequest,
    CoreInfo,
    CoreOutputs,
    CoreRequest,
    sequence_ids,
)
from pagedlm.engine.output_processor import OutputProcessor, RequestOutputKind
from pagedlm.outputs import BeamSearchOutput, CompletionOutput, RequestMetrics, RequestOutput
from pagedlm.sampling_params import BeamSearchParams, SamplingParams

_MASK64 = (1 << 64) - 1


def derive_seed(seed: int, index: int) -> int:
    """A well-mixed 63-bit seed for sample `index` of a request (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def eos_token_ids(hf_config, tokenizer) -> tuple[int, ...]:
    """The model's end-of-sequence ids: the config's, then the tokenizer's."""
    ids: list[int] = []
    for source in (getattr(hf_config, "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None):
        if source is None:
            continue
        for t in source if isinstance(source, (list, tuple)) else [source]:
            if t not in ids:
                ids.append(int(t))
    return tuple(ids)


class EngineFrontend:
    """Not thread-safe: one thread (the caller's or the event loop's) uses it."""

    def __init__(self, tokenizer, info: CoreInfo, seed: int | None) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.output_processor = OutputProcessor(tokenizer)
        self._seed_rng = random.Random(seed)
        # Beam searches: request id -> (prompt text, number of beams to return, arrival)
        self._beam_requests: dict[str, tuple[str | None, int, float]] = {}

    # ----- requests in -----------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine was created with skip_tokenizer_init=True: pass "
                             "prompts as {'prompt_token_ids': [...]}")
        return self.tokenizer(prompt).input_ids

    def has_request(self, request_id: str) -> bool:
        return self.output_processor.has_request(request_id) or request_id in self._beam_requests

    def make_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                     prompt_token_ids: Sequence[int] | None = None,
                     output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                     arrival_time: float | None = None, cache_salt: str | None = None,
                     lora_name: str | None = None) -> CoreRequest | CoreBeamRequest:
        """Validate a request and start tracking it; the caller hands the result to the
        core and calls `forget(request_id)` if the core refuses it. Raises ValueError."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if self.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("a request needs a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenize(prompt)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        self.validate_prompt(prompt_token_ids, params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        if params.use_beam_search:
            beam_params = BeamSearchParams(
                beam_width=params.best_of or params.n, max_tokens=params.max_tokens,
                ignore_eos=params.ignore_eos, temperature=params.temperature,
                length_penalty=params.length_penalty)
            return self.make_beam_request(request_id, prompt_token_ids, beam_params, prompt=prompt,
                                          num_returned=params.n, arrival_time=arrival,
                                          lora_name=lora_name)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.info.max_model_len - len(prompt_token_ids)
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        num_seqs = params.best_of or params.n
        seq_params = params
        if num_seqs > params.n and params.logprobs is None:
            # Ranking best_of samples needs each one's cumulative logprob.
            seq_params = params.clone()
            seq_params.logprobs = 0
        seeds = [base_seed] if num_seqs == 1 else [derive_seed(base_seed, i) for i in range(num_seqs)]
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, params, output_kind,
                                          sequence_ids(request_id, num_seqs), arrival)
        return CoreRequest(request_id, prompt_token_ids, seq_params, seeds, max_tokens, arrival,
                           cache_salt, lora_name)

    def make_beam_request(self, request_id: str, prompt_token_ids: list[int],
                          params: BeamSearchParams, prompt: str | None = None,
                          num_returned: int | None = None,
                          arrival_time: float | None = None,
                          lora_name: str | None = None) -> CoreBeamRequest:
        """A beam search; its RequestOutput (the best `num_returned` beams, default all)
        comes when the search ends, with the full BeamSearchOutput in
        `output.extra["beam_search"]`."""
        if self.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids, SamplingParams(max_tokens=params.max_tokens))
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self._beam_requests[request_id] = (prompt, num_returned or params.beam_width, arrival)
        return CoreBeamRequest(request_id, list(prompt_token_ids), params, lora_name)

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        num = len(prompt_token_ids)
        max_model_len, vocab_size = self.info.max_model_len, self.info.vocab_size
        if num == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids contains {bad}, outside the vocabulary [0, {vocab_size})")
        if num >= max_model_len:
            raise ValueError(
                f"the prompt has {num} tokens, but the maximum context length is "
                f"{max_model_len} tokens (max_model_len), leaving no room to generate"
            )
        if params.max_tokens is not None and num + params.max_tokens > max_model_len:
            raise ValueError(
                f"the prompt has {num} tokens and max_tokens is {params.max_tokens}: "
                f"{num + params.max_tokens} tokens in all, more than the maximum context length "
                f"of {max_model_len} tokens (max_model_len)"
            )

    def forget(self, request_id: str) -> None:
        """Stop tracking a request the core refused."""
        self._beam_requests.pop(request_id, None)
        self.output_processor.forget(request_id)

    # ----- outputs ---------------------------------------------------------------------------

    def process(self, core_out: CoreOutputs
                ) -> tuple[list[RequestOutput], list[str], list[str]]:
        """A step's RequestOutputs, the sequence ids a stop string finished (the core must
        be told to stop them) and the request ids that failed in the frontend (the core
        must be told to abort them). A request the core failed ends here with `error`."""
        outputs, stopped, failed = self.output_processor.process(core_out)
        for request_id, message in core_out.failed.items():
            if request_id in self._beam_requests:
                output = self._beam_output(request_id, None, finished_reason="error")
                output.error = message
            else:
                output = self.output_processor.fail(request_id, message)
            if output is not None:
                outputs.append(output)
        for request_id, result in core_out.beam_results:
            if request_id in self._beam_requests:
                outputs.append(self._beam_output(request_id, result))
        return outputs, stopped, failed

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """The final outputs of requests ended early (finish_reason "abort"); the caller
        tells the core. Unknown or finished ids are ignored."""
        outputs = []
        for request_id in request_ids:
            if request_id in self._beam_requests:
                outputs.append(self._beam_output(request_id, None, finished_reason="abort"))
                continue
            output = self.output_processor.abort(request_id)
            if output is not None:
                outputs.append(output)
        return outputs

    def _beam_output(self, request_id: str, result: BeamSearchOutput | None,
                     finished_reason: str | None = None) -> RequestOutput:
        prompt, num_returned, arrival = self._beam_requests.pop(request_id)
        now = time.monotonic()
        tokenizer = self.tokenizer
        completions = []
        for seq in result.sequences if result is not None else []:
            if tokenizer is not None:
                seq.text = tokenizer.decode(seq.tokens, skip_special_tokens=True)
        for i, seq in enumerate(result.sequences[:num_returned] if result is not None else []):
            generated = seq.generated_token_ids
            text = ""
            if tokenizer is not None:
                text = tokenizer.decode(generated, skip_special_tokens=True)
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
