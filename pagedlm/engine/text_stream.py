"""Incremental decoding of a sequence's token ids into text: the stream behind
pagedlm/engine/detokenizer.py's IncrementalDetokenizer (what "the text" is: its docstring).

Streaming guarantees
--------------------
* A delta never ends in the middle of a character: while the decoded window ends in U+FFFD
  (an incomplete UTF-8 sequence) nothing is emitted. U+FFFD appears in a delta only where
  the final text has it too.
* ByteFallback decoders (Llama/Mistral-style ``<0xNN>`` pieces) are not prefix-stable: a run
  of byte pieces decodes all-or-nothing, so ``<0x41>`` alone is "A" but ``<0x41><0x80>``
  is two U+FFFDs. Text from a run of byte pieces is therefore only emitted once a later
  decoder-visible non-byte token closes the run (or at finish).
* Per-step work is bounded by the tokens since the previous emission plus the tokens of that
  emission (the context window), never by the length of the text. (Tokens that add no
  complete text, e.g. a long run of skipped special tokens or invalid bytes, do widen the
  window until text appears.)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tokenizers import Tokenizer

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

# Tests flip this to run the pure-Python window algorithm on fast tokenizers too.
_USE_DECODE_STREAM = DecodeStream is not None

# Prompt tokens decoded as context for the first output tokens. One is enough for every
# common decoder (it absorbs the "strip the first leading space" rule); a few more are cheap.
_PROMPT_CONTEXT_TOKENS = 4
# The context is widened backwards so it starts on a non-byte piece (a whole ByteFallback
# run), but never by more than this many tokens.
_MAX_CONTEXT_WIDENING = 16

_REPLACEMENT_CHAR = "\ufffd"
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def _is_byte_piece(token: str | None) -> bool:
    """Whether ``token`` is a ByteFallback piece such as ``<0xE4>``."""
    return (
        token is not None
        and len(token) == 6
        and token.startswith("<0x")
        and token.endswith(">")
        and token[3] in _HEX_DIGITS
        and token[4] in _HEX_DIGITS
    )


# Tokenizer -> the ids of its byte pieces, found once per tokenizer: the gate asks about
# every generated token, and asking the tokenizer for each token's string cost more than
# the rest of the detokenizer's step (a byte-level BPE such as SmolLM2's has none at all).
_BYTE_PIECE_IDS: weakref.WeakKeyDictionary[Tokenizer, frozenset[int]] = weakref.WeakKeyDictionary()


def _byte_piece_ids(backend: Tokenizer) -> frozenset[int]:
    ids = _BYTE_PIECE_IDS.get(backend)
    if ids is None:
        ids = frozenset(i for token, i in backend.get_vocab(with_added_tokens=True).items()
                        if _is_byte_piece(token))
        _BYTE_PIECE_IDS[backend] = ids
    return ids


def _common_prefix_len(a: str, b: str) -> int:
    if a.startswith(b):
        return len(b)
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _ByteRunGate:
    """Tracks whether the decoder-visible tail of the token stream is an open run of
    ByteFallback pieces, whose decoded text may still change."""

    def __init__(self, is_byte_piece: Callable[[int], bool],
                 invisible: Callable[[int], bool] | None) -> None:
        self._is_byte_piece = is_byte_piece
        # Tokens the decoder never sees (skipped specials) neither close nor extend a run.
        self._invisible = invisible
        self.open = False

    def feed(self, token_id: int) -> bool:
        """Advance by one token; returns whether a byte run is open after it."""
        if self._is_byte_piece(token_id):
            self.open = True
        elif not (self.open and self._invisible is not None and self._invisible(token_id)):
            self.open = False
        return self.open


class _Stream(Protocol):
    def push(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class _WindowStream:
    """Pure-Python incremental decoding over any ``decode(ids) -> str``.

    Invariant: ``_ids[:_read]`` is the context (prompt tail, or the tokens of the previous
    emission) and ``_prefix_text == decode(_ids[:_read])``; ``_ids[_read:]`` are tokens whose
    text has not been emitted. ``_ids[:_closed]`` ends outside any open byte run.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], gate: _ByteRunGate,
                 context: Sequence[int]) -> None:
        self._decode = decode
        self._gate = gate
        self._ids = list(context)
        self._read = len(self._ids)
        self._prefix_text = decode(self._ids) if self._ids else ""
        self._closed = self._read

    def push(self, token_ids: Sequence[int]) -> str:
        for t in token_ids:
            self._ids.append(t)
            if not self._gate.feed(t):
                self._closed = len(self._ids)
        if self._closed <= self._read:
            return ""
        return self._emit(self._closed, final=False)

    def flush(self) -> str:
        if len(self._ids) <= self._read:
            return ""
        return self._emit(len(self._ids), final=True)

    def _emit(self, end: int, final: bool) -> str:
        text = self._decode(self._ids[:end])
        if not final and text.endswith(_REPLACEMENT_CHAR):
            return ""
        # The common prefix rather than len(_prefix_text): the first output tokens may
        # complete a character the prompt left unfinished, turning its U+FFFD into text.
        keep = _common_prefix_len(text, self._prefix_text)
        if len(text) <= keep:
            return ""
        # Slide the window: the tokens just emitted become the next context.
        self._ids = self._ids[self._read:]
        end -= self._read
        self._closed -= self._read
        self._read = end
        self._prefix_text = self._decode(self._ids[:end])
        return text[keep:]


class _DecodeStreamStream:
    """``tokenizers.decoders.DecodeStream`` (the Rust implementation of the same window
    algorithm) plus what it lacks: tokens of an open byte run are held back and fed only
    once the run is closed, and ``flush`` releases text it is still holding at the end.

    Only built when ``decode(context)`` is non-empty (or the context is empty) and does not
    end in U+FFFD, and no byte run is open at the end of the context: otherwise
    DecodeStream would emit the context's own text or raise on a changed prefix.

    Mirrors its state: ``_ctx`` are the tokens whose text is DecodeStream's current prefix,
    ``_fed`` the tokens fed since its last emission, ``_held`` those not fed yet.
    """

    def __init__(self, backend: Tokenizer, decode: Callable[[Sequence[int]], str],
                 gate: _ByteRunGate, context: Sequence[int], skip_special_tokens: bool) -> None:
        self._backend = backend
        self._decode = decode
        self._gate = gate
        self._ds = DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
        self._ctx = list(context)
        self._fed: list[int] = []
        self._held: list[int] = []
        # Set if DecodeStream ever fails; from then on the Python algorithm takes over.
        self._fallback: _WindowStream | None = None

    def push(self, token_ids: Sequence[int]) -> str:
        if self._fallback is not None:
            return self._fallback.push(token_ids)
        closed = 0
        for i, t in enumerate(token_ids):
            if not self._gate.feed(t):
                closed = i + 1
        self._held.extend(token_ids)
        if closed == 0:
            return ""
        n_unclosed = len(token_ids) - closed
        to_feed = self._held[: len(self._held) - n_unclosed]
        try:
            chunk = self._ds.step(self._backend, to_feed)
        except Exception:
            # A decoder that is not prefix-stable in some way not handled above. _ctx ends
            # outside any byte run, so the gate restarts closed and re-reads the pending tokens.
            self._gate.open = False
            self._fallback = _WindowStream(self._decode, self._gate, self._ctx)
            pending, self._fed, self._held = self._fed + self._held, [], []
            return self._fallback.push(pending)
        self._fed.extend(to_feed)
        del self._held[: len(to_feed)]
        if chunk is None:
            return ""
        self._ctx, self._fed = self._fed, []
        return chunk

    def flush(self) -> str:
        if self._fallback is not None:
            return self._fallback.flush()
        pending = self._fed + self._held
        if not pending:
            return ""
        prefix = self._decode(self._ctx) if self._ctx else ""
        text = self._decode(self._ctx + pending)
        self._ctx, self._fed, self._held = self._ctx + pending, [], []
        return text[_common_prefix_len(text, prefix):]


def _context_start(prompt: Sequence[int], is_byte_piece: Callable[[int], bool],
                   invisible: Callable[[int], bool] | None) -> int:
    start = max(0, len(prompt) - _PROMPT_CONTEXT_TOKENS)
    # Starting inside a byte run (which skipped specials do not interrupt) would decode part
    # of that run on its own, and a run that is invalid as a whole may be valid in part.
    limit = max(0, start - _MAX_CONTEXT_WIDENING)
    while start > limit and (is_byte_piece(prompt[start])
                             or (invisible is not None and invisible(prompt[start]))):
        start -= 1
    return start


def make_stream(tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool) -> _Stream:
    backend = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(
        tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        is_byte_piece: Callable[[int], bool] = _byte_piece_ids(backend).__contains__

        def decode(ids: Sequence[int]) -> str:
            return backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

        def invisible(t: int) -> bool:
            # Rust's notion of "special" is what decode skips; a normal token that decodes
            # to "" on its own is also treated as invisible, which only holds text longer.
            return backend.decode([t], skip_special_tokens=True) == ""
    else:
        backend = None
        special = frozenset(getattr(tokenizer, "all_special_ids", ()))

        def is_byte_piece(t: int) -> bool:
            return _is_byte_piece(tokenizer.convert_ids_to_tokens(t))

        def decode(ids: Sequence[int]) -> str:
            if skip_special_tokens:
                ids = [t for t in ids if t not in special]
            if not ids:
                return ""
            return tokenizer.convert_tokens_to_string(tokenizer.convert_ids_to_tokens(list(ids)))

        def invisible(t: int) -> bool:
            return t in special

    hidden = invisible if skip_special_tokens else None
    gate = _ByteRunGate(is_byte_piece, hidden)
    context = list(prompt_token_ids[_context_start(prompt_token_ids, is_byte_piece, hidden):])
    for t in context:
        gate.feed(t)
    if backend is not None and _USE_DECODE_STREAM and not gate.open:
        context_text = decode(context) if context else None
        if context_text is None or (context_text and not context_text.endswith(_REPLACEMENT_CHAR)):
            return _DecodeStreamStream(backend, decode, gate, context, skip_special_tokens)
    return _WindowStream(decode, gate, context)
