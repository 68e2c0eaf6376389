"""Structured outputs: JSON schema, any JSON object, regex, a choice of strings or a Lark
grammar, enforced token by token with llguidance.

    frontend                              engine core                        worker
    --------                              -----------                        ------
    StructuredOutputsParams.grammar()     one LLMatcher per sequence
      (compiled and validated: a bad      before each step: fill the      logits of the sampled
      schema is a ValueError naming       bitmask of every constrained    rows masked in place
      the field, before anything is       sequence, in llguidance's       (one vectorised pass)
      queued)                             threads, while the forward      -> sample
                                          runs (UniProc)
                                          after the step: each matcher
                                          consumes its sequence's token;
                                          a finished grammar stops it

A matcher follows its sequence's output tokens only, so preemption by recompute (which
replays them) and prefix caching (prompt tokens) do not touch it; each of n samples has
its own. A matcher that errs ends only its request.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """What the output must match; set exactly one field (vLLM's names).

    json: a JSON schema (dict or JSON text); json_object: any JSON object; regex: a regular
    expression the whole output matches; choice: one of these strings; grammar: a Lark
    grammar (llguidance's dialect; `start` is the start rule)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # The compiled llguidance grammar, filled in by grammar(); what the core uses.
    compiled: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        given = self._given()
        if len(given) != 1:
            raise ValueError(f"structured_outputs: set exactly one of {', '.join(_KINDS)} "
                             f"(got {', '.join(given) or 'none'})")

    def _given(self) -> list[str]:
        return [k for k in _KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self._given()[0]

    def grammar_text(self) -> str:
        """The llguidance grammar (compiled once), or ValueError naming the field and the
        problem: an invalid schema, an unsupported schema feature, a bad regex or grammar."""
        if self.compiled is not None:
            return self.compiled
        from llguidance import LLMatcher

        kind = self.kind
        _check_control_characters(kind, getattr(self, kind))
        try:
            if kind == "json":
                schema = self.json
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema must be an object")
                grammar = LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
            elif kind == "json_object":
                grammar = LLMatcher.grammar_from_json_schema({"type": "object"},
                                                             defaults=_JSON_DEFAULTS)
            elif kind == "regex":
                grammar = LLMatcher.grammar_from_regex(self.regex)
            elif kind == "choice":
                choices = self.choice
                if not choices or not all(isinstance(c, str) and c for c in choices):
                    raise ValueError("choice must be a non-empty list of non-empty strings")
                grammar = LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in choices))
            else:
                grammar = LLMatcher.grammar_from_lark(self.grammar)
        except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            raise ValueError(f"structured_outputs.{kind}: {e}") from None
        error = LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(f"structured_outputs.{kind}: {_one_line(error)}")
        self.compiled = grammar
        return grammar


# Compact JSON (no free whitespace between tokens): a model cannot pad its output with
# spaces until max_tokens, and the result is what json.dumps(separators=(",", ":")) writes.
_JSON_DEFAULTS = {"whitespace_flexible": False}


# C0 controls but tab, newline and carriage return, and DEL. llguidance's masks and its
# token check disagree on such a character in a regex or grammar literal (the mask allows
# what the check then rejects), so they are refused up front.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _check_control_characters(kind: str, value: object) -> None:
    texts = value if isinstance(value, list) else [value]
    for text in texts:
        if isinstance(text, str) and (match := _CONTROL.search(text)):
            raise ValueError(f"structured_outputs.{kind}: the control character "
                             f"U+{ord(match.group()):04X} is not supported in a constraint")


def _one_line(message: str) -> str:
    """llguidance's multi-line message on one line, bounded."""
    text = " ".join(line.strip() for line in message.strip().splitlines() if line.strip())
    return text if len(text) <= 500 else text[:497] + "..."


def make_llg_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
    """llguidance's view of the model's tokenizer (its vocabulary size is the model's:
    logits rows may be wider than the tokenizer's vocabulary)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                        eos_token=list(eos_token_ids) or None)


class PendingBitmask:
    """The token bitmask of a step's constrained sequences, filled in llguidance's threads
    while the forward runs. `rows` maps a sequence id to its row; `result()` waits for the
    fill. Pickling (a tensor-parallel step message) waits for it too."""

    def __init__(self, rows: dict[str, int], bitmask: torch.Tensor,
                 fill: Callable[[], None] | None) -> None:
        self.rows = rows
        self._bitmask = bitmask
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if fill is not None:
            self._thread = threading.Thread(target=self._run, args=(fill,),
                                            name="pagedlm-grammar-mask", daemon=True)
            self._thread.start()

    def _run(self, fill: Callable[[], None]) -> None:
        try:
            fill()
        except BaseException as e:  # re-raised in the step, never lost
            self._error = e

    def result(self) -> torch.Tensor:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error
        return self._bitmask

    def __getstate__(self) -> dict:
        return {"rows": self.rows, "_bitmask": self.result(), "_error": None, "_thread": None}


class RemoteBitmask:
    """Stands for a PendingBitmask in a tensor-parallel step message: the step goes to
    the ranks at once and the forward starts; the engine sends the mask to rank 0 (the
    only rank that samples) in a second message when llguidance has filled it, and rank 0
    reads it only when it samples. So the fill overlaps the forward across processes too.

    `receive` (set in each rank by its serving loop) reads the next mask message; a rank
    that did not sample this step drops the mask with `drain_unread`, so the messages stay
    in step."""

    receive: Callable[[], torch.Tensor] | None = None
    _unread: list[RemoteBitmask] = []

    def __init__(self, rows: dict[str, int]) -> None:
        self.rows = rows
        self._bitmask: torch.Tensor | None = None

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        RemoteBitmask._unread.append(self)

    def result(self) -> torch.Tensor:
        if self._bitmask is None:
            if RemoteBitmask.receive is None:
                raise RuntimeError("a remote grammar bitmask outside a tensor-parallel rank")
            self._bitmask = RemoteBitmask.receive()
            RemoteBitmask._unread.remove(self)
        return self._bitmask

    @classmethod
    def drain_unread(cls) -> None:
        """Read (and drop) the masks of this step that nothing asked for (none come to a
        rank that does not sample)."""
        while cls._unread:
            if cls.receive is None:
                cls._unread.clear()
            else:
                cls._unread[0].result()


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits[rows[i], t] = -inf wherever bit t of bitmask[i] is 0 (in place; vectorised:
    one shift-and-test over [len(rows), vocab], no Python loop over rows or tokens)."""
    import torch

    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    if allowed.shape[1] < vocab:  # ids beyond the tokenizer's vocabulary: never allowed
        pad = torch.zeros(allowed.shape[0], vocab - allowed.shape[1], dtype=torch.bool,
                          device=allowed.device)
        allowed = torch.cat([allowed, pad], dim=1)
    allowed = allowed.to(logits.device, non_blocking=True)
    sub = logits[rows]
    logits[rows] = sub.masked_fill(~allowed, float("-inf"))


class StructuredOutputManager:
    """The engine core's matchers: one per constrained sequence."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._llg_tokenizer = None
        self._executor = None
        self._matchers: dict[str, Any] = {}  # sequence id -> LLMatcher

    def _tokenizer(self):
        if self._llg_tokenizer is None:
            import llguidance

            self._llg_tokenizer = make_llg_tokenizer(self._load_tokenizer(), self.vocab_size,
                                                     self.eos_token_ids)
            self._executor = llguidance.LLExecutor()
        return self._llg_tokenizer

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, seq_ids: Sequence[str], params: StructuredOutputsParams) -> None:
        """A matcher per sequence; ValueError (nothing added) if the grammar does not
        compile against this tokenizer."""
        from llguidance import LLMatcher

        tokenizer = self._tokenizer()
        grammar = params.grammar_text()
        first = LLMatcher(tokenizer, grammar, log_level=0)
        if first.is_error():
            raise ValueError(f"structured_outputs.{params.kind}: "
                             f"{_one_line(first.get_error())}")
        for i, seq_id in enumerate(seq_ids):
            self._matchers[seq_id] = first if i == 0 else first.deep_copy()

    def remove(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)

    def bitmask_for(self, seq_ids: Sequence[str]) -> PendingBitmask | None:
        """Start filling the masks of the constrained ones among `seq_ids`."""
        rows = {s: i for i, s in enumerate(s for s in seq_ids if s in self._matchers)}
        if not rows:
            return None
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask_par

        bitmask = allocate_token_bitmask(len(rows), self._tokenizer().vocab_size)
        pairs = [(self._matchers[s], i) for s, i in rows.items()]
        executor = self._executor
        return PendingBitmask(rows, bitmask,
                              lambda: fill_next_token_bitmask_par(executor, pairs, bitmask))

    def consume(self, seq_id: str, token_id: int) -> tuple[bool, str | None]:
        """Advance a sequence's matcher by its sampled token. Returns (finished, error):
        finished when the grammar is complete (the sequence stops as if by EOS), error
        when the matcher cannot go on (the request fails alone)."""
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return False, None
        if not matcher.consume_token(token_id):
            return False, f"the structured-output matcher failed: {matcher.get_error()}"
        return matcher.is_stopped(), None
