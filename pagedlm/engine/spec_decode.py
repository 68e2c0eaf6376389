"""Speculative decoding, the engine core's side: proposing drafts and counting what the
model accepted. (The scheduler gives a request with drafts 1 + k query tokens; the model
runner samples at each of them and accepts the drafts its samples agree with; the
scheduler then appends the accepted tokens and frees the blocks rejected drafts used.)

    step:  schedule (drafts verified)  ->  model  ->  update_from_output
           -> record(accepted per request)  ->  propose(next drafts)

Proposer "ngram" (prompt lookup): the last n tokens of a sequence, n from
prompt_lookup_max down to prompt_lookup_min, are looked up earlier in the sequence (its
prompt and its output); the tokens that followed their most recent earlier occurrence are
the drafts. Each sequence keeps an index of its n-grams, grown as tokens arrive: a lookup
costs O(1), whatever the context length. How many drafts follows from how long the match
is: the n-gram and the tokens before it that also agree with those before the earlier
occurrence, m in all, give at most m - 1 drafts. A sequence that is copying a passage
matches far back and gets all k; a chance match of two tokens gets one. On the repeating
ShareGPT turns (README, Speculative decoding), the first draft after a 2-token match was
accepted in 58% of verifications and the fourth in 25%, while after a match of 33 or more
all of 15 drafts were in 93%: with the cap, 15 drafts beat 6 without it, where 15 without
it lose to 6 (rows past the first rejection cost a CPU real compute).

Backing off, so that speculation never costs more than it saves:
  * per sequence, the number of drafts adapts to what was accepted: all accepted, one
    more next time (up to num_speculative_tokens); none, one fewer; at zero the sequence
    rests for a while (n-gram: 1 step, a draft model: 8, doubling each time) before it
    tries one draft again, and gives up for good rather than rest longer than 256 steps
    (16 for a draft model, whose every try costs it a catch-up forward over what it
    missed). A draft model also proposes at most n + 1 after n of more were accepted.
    For n-gram drafts, which cost nothing to propose, a verification row costs about an
    eighth of a step with int8 weights: a short rest and keeping the count after a partial
    acceptance gave 1-5% more speed than 8-step rests and the n + 1 cap, measured
    interleaved on ShareGPT (README, Speculative decoding);
  * per step, no drafts at all while more sequences decode than `disable_by_batch_size`:
    a large batch is compute bound and the verification rows would cost real time;
  * for a draft model, whose every new sequence first costs a prefill of its prompt in
    the draft: while under 15% of the drafts of the last 64 verifications were accepted,
    new sequences do not speculate, but one in 32 (so that a change of workload is seen).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedlm.config import SpeculativeConfig
from pagedlm.core.request import Request

REST_STEPS = 8  # a sequence whose drafts all failed first rests this many steps (draft model)
NGRAM_REST_STEPS = 1  # the same for n-gram drafts
MAX_REST_STEPS = 256
_FOREVER = 1 << 62
RECENT = 64  # verifications the dormancy rule looks back over
PROBE_EVERY = 32  # a dormant proposer still lets one new sequence in this many speculate


@dataclass
class SpecStats:
    """Counters since start, named after vLLM's spec_decode metrics."""

    num_drafts: int = 0  # verifications (a request with drafts, in one step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # drafts accepted at position i

    def engine_stats_fields(self) -> dict:
        """These counters as EngineStats fields."""
        return dict(spec_num_drafts=self.num_drafts, spec_num_draft_tokens=self.num_draft_tokens,
                    spec_num_accepted_tokens=self.num_accepted_tokens,
                    spec_accepted_per_pos=tuple(self.accepted_per_pos))


class _SeqState:
    __slots__ = ("index", "indexed", "num_drafts", "rest", "rest_length")

    def __init__(self, num_drafts: int, rest_length: int) -> None:
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> position after its last end
        self.indexed = 0  # n-grams ending before this position are in the index
        self.num_drafts = num_drafts
        self.rest = 0
        self.rest_length = rest_length


class Proposer:
    """What every proposer shares: the counters, the back-off, forgetting sequences.
    Subclasses draft in `_draft(requests, counts)`, setting `spec_token_ids`."""

    # A sequence whose drafts all failed first rests this many steps (doubling each time);
    # rests longer than max_rest_steps are not taken: it stops speculating for good.
    # After n of more drafts were accepted, at most n + partial_extra next time (None: as
    # many as before). These defaults suit drafts that cost something to propose (a draft
    # model); the n-gram proposer's are below.
    rest_steps = REST_STEPS
    max_rest_steps = MAX_REST_STEPS
    partial_extra: int | None = 1
    start_with_all = True  # a new sequence's first drafts: all k (else one, growing)
    # Below this share of drafts accepted over the last RECENT verifications, new sequences
    # do not speculate (but one in PROBE_EVERY, to notice when it would pay again): for a
    # proposer whose every sequence costs something up front (a draft model's prefill).
    min_recent_acceptance = 0.0

    def __init__(self, config: SpeculativeConfig, default_max_batch: int) -> None:
        self.k = config.num_speculative_tokens
        self.max_batch = config.disable_by_batch_size or default_max_batch
        self.stats = SpecStats(accepted_per_pos=[0] * self.k)
        self._seqs: dict[str, _SeqState] = {}
        self._recent: deque[tuple[int, int]] = deque(maxlen=RECENT)  # (accepted, drafted)
        self._new_since_probe = 0

    def forget(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)

    def record(self, spec: dict[str, list[int]], accepted: dict[str, list[int]]) -> None:
        """The verifications of a step: how many of each request's drafts were accepted."""
        stats = self.stats
        for seq_id, drafts in spec.items():
            n = len(accepted.get(seq_id, ()))
            stats.num_drafts += 1
            stats.num_draft_tokens += len(drafts)
            stats.num_accepted_tokens += n
            self._recent.append((n, len(drafts)))
            for pos in range(n):
                stats.accepted_per_pos[pos] += 1
            state = self._seqs.get(seq_id)
            if state is None:
                continue
            if n == len(drafts):
                state.num_drafts = min(self.k, state.num_drafts + 1)
                state.rest_length = self.rest_steps
            elif n > 0:
                # Some accepted: next time no more than those and partial_extra, for the row
                # after the last accepted draft was the first to fail (a verification's rows
                # cost real compute on a CPU; full acceptances grow it again).
                if self.partial_extra is not None:
                    state.num_drafts = min(state.num_drafts, n + self.partial_extra)
            else:
                state.num_drafts -= 1
                if state.num_drafts == 0:
                    if state.rest_length > self.max_rest_steps:
                        state.rest = _FOREVER  # it never pays off for this sequence
                        continue
                    state.rest = state.rest_length
                    state.rest_length *= 2

    def propose(self, decoding: list[Request]) -> None:
        """Set `spec_token_ids` of the given decoding sequences (those that may speculate)."""
        if len(decoding) > self.max_batch:
            return
        requests, counts = [], []
        for request in decoding:
            state = self._seqs.get(request.request_id)
            if state is None:
                state = self._seqs[request.request_id] = _SeqState(
                    self.k if self.start_with_all else 1, self.rest_steps)
                if self.dormant():
                    self._new_since_probe += 1
                    if self._new_since_probe < PROBE_EVERY:
                        state.num_drafts, state.rest = 0, _FOREVER
                    else:
                        self._new_since_probe = 0
            if state.num_drafts == 0:
                if state.rest > 0:
                    state.rest -= 1
                    continue
                state.num_drafts = 1
            requests.append(request)
            counts.append(state.num_drafts)
        if requests:
            self._draft(requests, counts)

    def dormant(self) -> bool:
        """Too few drafts accepted lately for new sequences to start speculating."""
        if not self.min_recent_acceptance or len(self._recent) < RECENT // 2:
            return False
        accepted = sum(a for a, _ in self._recent)
        return accepted < self.min_recent_acceptance * sum(d for _, d in self._recent)

    def _draft(self, requests: list[Request], counts: list[int]) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class NgramProposer(Proposer):
    rest_steps = NGRAM_REST_STEPS
    partial_extra = None
    # After a match of m tokens (the looked-up n-gram and as many tokens before it as also
    # agree), at most m - match_slack drafts (at least one); None: no such cap.
    match_slack: int | None = 1

    def __init__(self, config: SpeculativeConfig, default_max_batch: int) -> None:
        super().__init__(config, default_max_batch)
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max

    def _draft(self, requests: list[Request], counts: list[int]) -> None:
        for request, k in zip(requests, counts):
            drafts = self._lookup(self._seqs[request.request_id], request.all_token_ids, k)
            if drafts:
                request.spec_token_ids = drafts

    def _lookup(self, state: _SeqState, tokens: list[int], k: int) -> list[int]:
        slack = self.match_slack
        # The match is only followed as far back as k drafts could use it.
        match = self._match(state, tokens, 0 if slack is None else k + slack)
        if match is None:
            return []
        after, m = match
        if slack is not None:
            k = min(k, max(1, m - slack))
        return tokens[after:after + k]

    def _match(self, state: _SeqState, tokens: list[int], limit: int) -> tuple[int, int] | None:
        """Where the sequence's suffix occurred last (the position after that occurrence)
        and how long the match is: the n-gram found (n_max down to n_min tokens) and the
        tokens before it that also agree, counted up to `limit`. None if no n-gram matches."""
        length = len(tokens)
        index = state.index
        n_min, n_max = self.n_min, self.n_max
        # Index the n-grams that end before the last token (the suffix must be found
        # earlier, not at its own place); the most recent occurrence wins.
        for end in range(state.indexed, length - 1):
            for n in range(n_min, min(n_max, end + 1) + 1):
                index[tuple(tokens[end + 1 - n:end + 1])] = end + 1
        state.indexed = max(state.indexed, length - 1)
        for n in range(min(n_max, length), n_min - 1, -1):
            after = index.get(tuple(tokens[length - n:]))
            if after is not None:
                m, stop = n, min(after, limit)
                while m < stop and tokens[after - 1 - m] == tokens[length - 1 - m]:
                    m += 1
                return after, m
        return None
