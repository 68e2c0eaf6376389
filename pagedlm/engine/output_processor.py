"""From per-step model results to RequestOutputs: detokenize, stop strings, logprobs.

A user request with n > 1 fans out into n sequences that the scheduler treats as
independent requests ("{i}_{request_id}"); this module gathers them back into one
RequestOutput.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

from pagedlm.engine.core_io import CoreOutputs
from pagedlm.engine.detokenizer import IncrementalDetokenizer
from pagedlm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedlm.sampling_params import SamplingParams
from pagedlm.worker.model_runner import TokenLogprobs

logger = logging.getLogger(__name__)


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every update carries everything so far
    DELTA = 1  # every update carries only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SequenceState:
    seq_id: str
    index: int
    detokenizer: IncrementalDetokenizer | None
    logprobs: list | None
    cumulative_logprob: float | None
    output_token_ids: list[int] = field(default_factory=list)
    num_published_tokens: int = 0
    num_published_logprobs: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: RequestOutputKind
    sequences: list[SequenceState]
    metrics: RequestMetrics
    prompt_logprobs: dict[int, dict[int, Logprob]] | None = None
    prompt_logprobs_published: bool = False
    finished: set[int] = field(default_factory=set)

    @property
    def is_finished(self) -> bool:
        return len(self.finished) == len(self.sequences)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.seq_to_state: dict[str, tuple[RequestState, SequenceState]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, output_kind: RequestOutputKind,
                    seq_ids: list[str], arrival_time: float) -> None:
        if (params.best_of or params.n) > params.n:
            # The n best are known only at the end.
            output_kind = RequestOutputKind.FINAL_ONLY
        seqs = []
        for i, seq_id in enumerate(seq_ids):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                    final_only=output_kind == RequestOutputKind.FINAL_ONLY,
                )
            wants_logprobs = params.logprobs is not None
            ranked = (params.best_of or params.n) > params.n
            seqs.append(SequenceState(seq_id, i, detok, [] if wants_logprobs else None,
                                      0.0 if wants_logprobs or ranked else None))
        state = RequestState(request_id, prompt, prompt_token_ids, params, output_kind, seqs,
                             RequestMetrics(arrival_time=arrival_time),
                             prompt_logprobs={} if params.prompt_logprobs is not None else None)
        self.states[request_id] = state
        for seq in seqs:
            self.seq_to_state[seq.seq_id] = (state, seq)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.states

    def sequence_ids(self, request_id: str) -> list[str]:
        state = self.states.get(request_id)
        return [s.seq_id for s in state.sequences] if state else []

    def process(self, core_out: CoreOutputs
                ) -> tuple[list[RequestOutput], list[str], list[str]]:
        """Returns the outputs to publish, the sequence ids a stop string finished (the
        core must stop them, which frees their blocks) and the request ids that failed here
        (an exception while detokenizing one: it ends with an error, the core must abort
        it, the other requests go on). Outputs of sequences this processor no longer
        tracks (already stopped by a string, aborted, failed) are dropped."""
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        failed: dict[str, str] = {}
        seq_to_state = self.seq_to_state
        for seq_id in core_out.scheduled_seq_ids:
            entry = seq_to_state.get(seq_id)
            if entry is not None and entry[0].metrics.first_scheduled_time is None:
                entry[0].metrics.first_scheduled_time = now
        for seq_id, rows in core_out.prompt_logprobs.items():
            entry = seq_to_state.get(seq_id)
            if entry is None or entry[0].prompt_logprobs is None:
                continue
            try:
                for position, lp in rows:
                    entry[0].prompt_logprobs[position] = self._position_logprobs(lp)
            except Exception as e:
                failed[entry[0].request_id] = _describe_failure(entry[0].request_id, e)
        stopped_by_string = []
        for seq_out in core_out.outputs:
            entry = seq_to_state.get(seq_out.seq_id)
            if entry is None:
                continue
            state, seq = entry
            if seq.finish_reason is not None or state.request_id in failed:
                continue  # a stop string ended it; the core computed one token more
            touched[state.request_id] = state
            try:
                if self._update(state, seq, seq_out, now):
                    stopped_by_string.append((seq_out.seq_id, state.request_id))
            except Exception as e:
                failed[state.request_id] = _describe_failure(state.request_id, e)
        outputs = []
        final_only = RequestOutputKind.FINAL_ONLY
        for state in touched.values():
            finished = state.is_finished
            if (not finished and state.output_kind == final_only) or state.request_id in failed:
                continue  # nothing to publish yet (offline requests publish once, at the end)
            if finished:
                state.metrics.finished_time = now
                state.metrics.num_preemptions = sum(s.num_preemptions for s in state.sequences)
            try:
                output = self._make_output(state)
            except Exception as e:
                failed[state.request_id] = _describe_failure(state.request_id, e)
                continue
            outputs.append(output)
            if finished:
                self._forget(state)
        for request_id, message in failed.items():
            output = self.fail(request_id, message)
            if output is not None:
                outputs.append(output)
        stopped = [seq_id for seq_id, request_id in stopped_by_string if request_id not in failed]
        return outputs, stopped, list(failed)

    def _update(self, state: RequestState, seq: SequenceState, seq_out, now: float) -> bool:
        """Apply one sequence's new token. True if a stop string finished it just now."""
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        state.metrics.last_token_time = now
        token_id = seq_out.token_id
        seq.output_token_ids.append(token_id)
        lp = seq_out.logprobs
        if lp is not None:
            if seq.logprobs is not None:
                seq.logprobs.append(self._position_logprobs(lp))
            if seq.cumulative_logprob is not None:
                seq.cumulative_logprob += lp.logprob
        if seq_out.finish_reason is not None:
            seq.finish_reason = seq_out.finish_reason
            seq.stop_reason = seq_out.stop_reason
            seq.num_preemptions = seq_out.num_preemptions
        stopped_by_string = False
        if seq.detokenizer is not None:
            # A stop token (EOS or stop_token_ids) is kept in token_ids but not in the text.
            stopped_by_token = seq_out.finish_reason == "stop" and not seq_out.grammar_done
            if not stopped_by_token or state.params.include_stop_str_in_output:
                stop_str = seq.detokenizer.update([token_id])
                if stop_str is not None:
                    stopped_by_string = seq.finish_reason is None
                    seq.finish_reason, seq.stop_reason = "stop", stop_str
        if seq.finish_reason is not None:
            state.finished.add(seq.index)
        return stopped_by_string

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        """End a request with an error (its own failure): a final output with `error` set
        and finish_reason "error", without text (its detokenizer may be what failed)."""
        state = self.states.get(request_id)
        if state is None:
            return None
        self._forget(state)
        state.metrics.finished_time = time.monotonic()
        return RequestOutput(
            request_id=request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            outputs=[CompletionOutput(index=i, text="", token_ids=[], finish_reason="error")
                     for i in range(state.params.n)],
            finished=True, metrics=state.metrics, error=message)

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self.states.get(request_id)
        if state is None:
            return None
        for seq in state.sequences:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
                state.finished.add(seq.index)
        state.metrics.finished_time = time.monotonic()
        output = self._make_output(state)
        self._forget(state)
        return output

    def forget(self, request_id: str) -> None:
        """Drop a request without an output (the core refused it)."""
        state = self.states.get(request_id)
        if state is not None:
            self._forget(state)

    def _forget(self, state: RequestState) -> None:
        del self.states[state.request_id]
        for seq in state.sequences:
            self.seq_to_state.pop(seq.seq_id, None)

    def _position_logprobs(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        ids = [lp.token_id] + [t for t in lp.top_ids if t != lp.token_id]
        texts = self._decode_each(ids)
        entry = {lp.token_id: Logprob(lp.logprob, lp.rank, texts[0])}
        for rank, (tid, tlp) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            if tid not in entry:
                entry[tid] = Logprob(tlp, rank, texts[len(entry)])
        return entry

    def _decode_each(self, ids: list[int]) -> list[str | None]:
        if self.tokenizer is None:
            return [None] * len(ids)
        return self.tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=False)

    def _make_output(self, state: RequestState) -> RequestOutput:
        """The request's output now (process() calls it for a final-only request only once
        the request is finished)."""
        delta = state.output_kind == RequestOutputKind.DELTA
        completions = [self._completion(seq, delta, state.is_finished) for seq in state.sequences]
        if len(completions) > state.params.n:
            # best_of: keep the n samples with the highest cumulative logprob, best first.
            completions.sort(key=lambda c: c.cumulative_logprob or 0.0, reverse=True)
            completions = completions[: state.params.n]
            for i, c in enumerate(completions):
                c.index = i
        prompt_logprobs = None
        if state.prompt_logprobs is not None and not (delta and state.prompt_logprobs_published):
            n = len(state.prompt_token_ids)
            prompt_logprobs = [None] + [state.prompt_logprobs.get(p) for p in range(1, n)]
            state.prompt_logprobs_published = True
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=state.is_finished,
            prompt_logprobs=prompt_logprobs,
            metrics=state.metrics,
        )

    def _completion(self, seq: SequenceState, delta: bool, request_finished: bool) -> CompletionOutput:
        token_ids = seq.output_token_ids
        finished = seq.finish_reason is not None
        text = ""
        if seq.detokenizer is not None:
            text = seq.detokenizer.get_next_output_text(finished, delta)
        logprobs = seq.logprobs
        if delta:
            token_ids = token_ids[seq.num_published_tokens :]
            if logprobs is not None:
                logprobs = logprobs[seq.num_published_logprobs :]
        seq.num_published_tokens = len(seq.output_token_ids)
        seq.num_published_logprobs = len(seq.logprobs) if seq.logprobs is not None else 0
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )


def _describe_failure(request_id: str, error: Exception) -> str:
    logger.exception("processing the output of request %s failed", request_id,
                     exc_info=error)
    return f"processing this request's output failed ({type(error).__name__}: {error})"
