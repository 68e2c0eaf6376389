"""Beam search on the paged engine: beams are requests that share blocks.

Every step each live beam of a group computes one token and reports its top-K
continuations (K = (number of EOS ids + 1) * beam_width, as HF transformers keeps).
When every beam of the group has reported, the group selects, with HF transformers'
rules:

  * candidates are ranked by cumulative logprob over all beams;
  * a candidate that ends in EOS (or reaches max_tokens) finishes, but only if it ranks
    among the top `beam_width`; it is scored cum_logprob / generated_len ** length_penalty
    and the best `beam_width` finished hypotheses are kept;
  * the best `beam_width` unfinished candidates are the next beams;
  * the search stops when no candidate can continue, or (early_stopping=False heuristic)
    when `beam_width` hypotheses are finished and the best running beam's score at the
    current length cannot beat the worst of them.

A parent chosen once keeps its request: only its last, not yet computed token is
swapped. A parent chosen k times forks k - 1 children that share all its blocks (the
partly filled last block is copied when first written). A parent not chosen is aborted
and its blocks go back to the pool at once.

The driver is policy only: it never touches the scheduler. It hands the engine core each
group's first beam to schedule, and after every step a BeamSelection per group that
selected (the children to fork, each with its parent, and the beams to abort), which the
core applies in order. Beams are linked to their user request by the group that owns
them (`owner`, `BeamGroup.request_id`), never by parsing ids.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pagedlm.core.request import Request
from pagedlm.outputs import BeamSearchOutput, BeamSearchSequence
from pagedlm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class _Hypothesis:
    tokens: list[int]
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass
class BeamGroup:
    request_id: str  # the user request this search answers
    prompt_token_ids: list[int]
    params: BeamSearchParams
    eos_token_ids: tuple[int, ...]
    lora: object | None = None  # every beam's LoRA adapter (lora.adapter.LoRAAdapter)
    beams: dict[str, float] = field(default_factory=dict)  # live request id -> cum logprob
    requests: dict[str, Request] = field(default_factory=dict)
    candidates: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    finished: list[_Hypothesis] = field(default_factory=list)
    improvement_possible: bool = True
    done: bool = False

    @property
    def num_candidates(self) -> int:
        stops = 0 if self.params.ignore_eos else len(self.eos_token_ids)
        return (stops + 1) * self.params.beam_width

    def score(self, cum_logprob: float, generated_len: int) -> float:
        return cum_logprob / (generated_len ** self.params.length_penalty)


@dataclass
class BeamSelection:
    """One group's selection, for the core to apply to its scheduler: the forks first, in
    order (a fork starts running only while there is room under max_num_seqs), then the
    aborts."""

    forks: list[tuple[Request, Request]] = field(default_factory=list)  # (parent, child)
    aborted: list[str] = field(default_factory=list)  # beam request ids


class BeamSearchDriver:
    """Beam-search groups on the engine core, advanced by it after every step."""

    def __init__(self, eos_token_ids: tuple[int, ...]) -> None:
        self.eos_token_ids = eos_token_ids
        self._ids = itertools.count()
        self.groups: dict[str, BeamGroup] = {}  # user request id -> group
        self.owner: dict[str, BeamGroup] = {}  # beam request id -> group

    def add(self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams,
            lora=None) -> Request:
        """Start a search; returns its first beam for the core to schedule (if that
        fails, `abort(request_id)` forgets the search)."""
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        group = BeamGroup(request_id, list(prompt_token_ids), params, self.eos_token_ids, lora)
        request = self._new_request(group, group.prompt_token_ids)
        self.groups[request_id] = group
        self._track(group, self.owner, request, 0.0)
        return request

    def has_groups(self) -> bool:
        return bool(self.groups)

    def has(self, request_id: str) -> bool:
        return request_id in self.groups

    def request_of(self, beam_id: str) -> str | None:
        """The user request a live beam belongs to (None: not a beam)."""
        group = self.owner.get(beam_id)
        return None if group is None else group.request_id

    def abort(self, request_id: str) -> list[str] | None:
        """Forget a search; returns its beams' ids for the core to abort (None: no such
        search)."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        return self._abort(list(group.requests.values()), self.owner)

    def on_step(self, record) -> tuple[list[BeamSelection], list[tuple[str, BeamSearchOutput]]]:
        """Record this step's candidates; select for every group whose beams all reported.
        Returns the selections made, in order, and the groups that finished, as (request
        id, output)."""
        for request in record.updated:
            group = self.owner.get(request.request_id)
            if group is None:
                continue
            lp = record.result.logprobs[request.request_id]
            group.candidates[request.request_id] = list(zip(lp.top_ids, lp.top_logprobs))
            request.paused = not request.is_finished()
        selections, finished = [], []
        for request_id, group in list(self.groups.items()):
            if group.beams and set(group.candidates) >= set(group.beams):
                selections.append(self._select(group, self.owner))
                if group.done:
                    del self.groups[request_id]
                    finished.append((request_id, self._output(group)))
        return selections, finished

    def _new_request(self, group: BeamGroup, token_ids: list[int]) -> Request:
        params = SamplingParams(temperature=0.0, max_tokens=group.params.max_tokens,
                                ignore_eos=True, detokenize=False)
        # K may exceed the user-facing logprobs cap; this is an internal request.
        params.logprobs = group.num_candidates
        return Request(f"beam-{next(self._ids)}", token_ids, params, seed=0,
                       eos_token_ids=self.eos_token_ids,
                       max_tokens=group.params.max_tokens, lora=group.lora)

    @staticmethod
    def _track(group: BeamGroup, owner: dict, request: Request, cum: float) -> None:
        group.beams[request.request_id] = cum
        group.requests[request.request_id] = request
        owner[request.request_id] = group

    def _select(self, group: BeamGroup, owner: dict[str, BeamGroup]) -> BeamSelection:
        width = group.params.beam_width
        some = next(iter(group.requests.values()))
        generated_len = some.num_output_tokens  # the candidates' generated length
        stops = set() if group.params.ignore_eos else set(group.eos_token_ids)
        ranked = sorted(
            ((group.beams[rid] + lp, rid, token) for rid, cands in group.candidates.items()
             for token, lp in cands),
            key=lambda c: c[0], reverse=True,
        )[: group.num_candidates]
        at_max = generated_len >= group.params.max_tokens

        running: list[tuple[float, str, int]] = []
        new_finished: list[_Hypothesis] = []
        for rank, (cum, rid, token) in enumerate(ranked):
            request = group.requests[rid]
            if token in stops or at_max:
                if rank < width and group.improvement_possible:
                    tokens = request.all_token_ids[:-1] + [token]
                    reason = "stop" if token in stops else "length"
                    new_finished.append(_Hypothesis(tokens, cum, group.score(cum, generated_len), reason))
            elif len(running) < width:
                running.append((cum, rid, token))
        group.finished = sorted(group.finished + new_finished, key=lambda h: h.score,
                                reverse=True)[:width]
        if running and len(group.finished) == width:
            best_running = group.score(running[0][0], generated_len)
            if best_running <= group.finished[-1].score:
                group.improvement_possible = False

        old = dict(group.requests)
        group.beams.clear()
        group.requests.clear()
        group.candidates.clear()
        selection = BeamSelection()
        if not running or not group.improvement_possible:
            group.done = True
            selection.aborted = self._abort(old.values(), owner)
            return selection
        reused: set[str] = set()
        for cum, rid, token in running:
            parent = old[rid]
            if rid not in reused:
                reused.add(rid)
                parent.replace_last_token(token)
                parent.paused = False
                self._track(group, owner, parent, cum)
            else:
                child = self._new_request(group, parent.prompt_token_ids)
                child.output_token_ids = parent.output_token_ids[:-1] + [token]
                child.all_token_ids = parent.all_token_ids[:-1] + [token]
                selection.forks.append((parent, child))
                self._track(group, owner, child, cum)
        selection.aborted = self._abort([r for rid, r in old.items() if rid not in reused],
                                        owner)
        return selection

    @staticmethod
    def _abort(requests, owner: dict) -> list[str]:
        """Stop tracking these beams; returns their ids for the core to abort."""
        ids = [r.request_id for r in requests]
        for rid in ids:
            owner.pop(rid, None)
        return ids

    def _output(self, group: BeamGroup) -> BeamSearchOutput:
        sequences = []
        for h in group.finished:  # the frontend fills in the text
            sequences.append(BeamSearchSequence(
                tokens=h.tokens, cum_logprob=h.cum_logprob, text=None, finish_reason=h.finish_reason,
                score=h.score, num_prompt_tokens=len(group.prompt_token_ids)))
        return BeamSearchOutput(sequences=sequences)
