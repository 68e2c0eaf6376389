"""Incremental detokenization and stop-string matching, one instance per generated sequence.

What "the text" of a sequence is
--------------------------------
Let ``D(ids)`` be the tokenizer's own decode with the request's ``skip_special_tokens`` and no
clean-up of tokenization spaces (for a fast tokenizer: ``backend_tokenizer.decode``, which is
what ``tokenizer.decode(ids, skip_special_tokens=s, clean_up_tokenization_spaces=False)``
returns). With prompt ``P`` and output ``O``, once the sequence is finished (and no stop string
cut it short)::

    output_text == D(P + O)[len(common_prefix(D(P + O), D(P))):]

i.e. the text the output adds after the prompt's text, decoded *in context*: a
SentencePiece-style leading space of the first output token is kept, and a character whose
bytes straddle the prompt/output boundary belongs to the output. When ``D(P + O)`` starts
with ``D(P)`` (the normal case) this is simply ``D(P + O)[len(D(P)):]``; for byte-level BPE
(GPT-2 style) it is ``D(O)`` whenever the prompt ends on a character boundary. Only the last
few prompt tokens are decoded as context (widened to the start of a trailing ByteFallback
run, up to 16 more tokens), which gives the same answer for the decoders in use, as they are
local: byte-level, Metaspace/Strip, ByteFallback. A raw ``tokenizers.Tokenizer`` is accepted
as well as a transformers tokenizer; one without a Rust backend goes through
``convert_ids_to_tokens`` + ``convert_tokens_to_string``, and then ``D`` means exactly that.

Streaming guarantees: pagedlm/engine/text_stream.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedlm.engine.text_stream import make_stream


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, step by step, and finds stop
    strings in it. See the module docstring for what the text is compared against."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], *,
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, final_only: bool = False) -> None:
        """`final_only`: the text is read only once the sequence ends (an offline request
        with no stop string): tokens are then kept and decoded in one go when the text is
        read, not one step at a time. The text is the same (decoding is prefix-stable,
        and the stream feeds any run of tokens at once)."""
        # "" would match everywhere; SamplingParams should reject it, this is a backstop.
        self._stops = tuple(s for s in stop if s)
        self._deferred: list[int] | None = [] if final_only and not self._stops else None
        self._include_stop = include_stop_str_in_output
        max_stop_len = max((len(s) for s in self._stops), default=0)
        self._lookback = max(0, max_stop_len - 1)
        self._holdback = 0 if include_stop_str_in_output else self._lookback
        self._stream = make_stream(tokenizer, prompt_token_ids, skip_special_tokens)
        self._published: list[str] = []
        # Text not yet returned by get_next_output_text, kept in chunks so that appending is
        # O(len(chunk)) even when nothing is published until the end. Invariant while not
        # done: it contains _tail whenever hold-back is active, so a stop-string cut never
        # reaches published text.
        self._pending: list[str] = []
        self._pending_len = 0
        self._tail = ""  # last _lookback characters of the text, for matches across steps
        self._stop_str: str | None = None
        self._done = False

    @property
    def output_text(self) -> str:
        """All text so far (trimmed at a stop string), published or not."""
        self._catch_up()
        return self._published_text() + "".join(self._pending)

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the text, if any."""
        return self._stop_str

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Append newly generated tokens (usually one). Returns the stop string if one was
        matched (the text is then trimmed: cut right before the stop string, or right after
        it when include_stop_str_in_output), else None. Ignored once stopped or finished."""
        if self._done:
            return None
        if self._deferred is not None:
            self._deferred.extend(new_token_ids)
            return None
        return self._append(self._stream.push(new_token_ids))

    def _catch_up(self) -> None:
        """Decode the tokens kept back (final_only)."""
        if self._deferred and not self._done:
            ids, self._deferred = self._deferred, []
            self._append(self._stream.push(ids))

    def finish(self) -> str | None:
        """Release text still held for an incomplete character or an open byte run (it then
        decodes with U+FFFD, exactly as the full decode does). Returns a stop string if the
        released text completes one. Idempotent; get_next_output_text(finished=True) calls it."""
        if self._done:
            return None
        self._catch_up()
        stop = self._append(self._stream.flush())
        self._done = True
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to publish now. While not finished, hold back the last (max stop len - 1)
        characters (when stop strings are set and not include_stop_str_in_output) so a stop
        string arriving over several tokens is never streamed and then retracted.
        delta=True returns only what was not returned before; delta=False the whole text
        published so far. When finished, everything is released."""
        if finished:
            self.finish()
        else:
            self._catch_up()
        n = self._pending_len if self._done else max(0, self._pending_len - self._holdback)
        chunk = ""
        if n:
            pending = "".join(self._pending)
            chunk, rest = pending[:n], pending[n:]
            self._pending = [rest] if rest else []
            self._pending_len = len(rest)
            self._published.append(chunk)
        return chunk if delta else self._published_text()

    def _published_text(self) -> str:
        if len(self._published) > 1:
            self._published[:] = ["".join(self._published)]
        return self._published[0] if self._published else ""

    def _append(self, text: str) -> str | None:
        if not text:
            return None
        self._pending.append(text)
        self._pending_len += len(text)
        if not self._stops:
            return None
        region = self._tail + text
        best_at, best = -1, None
        for s in self._stops:
            # Only matches that end inside the new text; earlier ones were already checked.
            at = region.find(s, max(0, len(self._tail) - len(s) + 1))
            if at < 0:
                continue
            # Earliest start wins; on a tie the shorter string, which completed first.
            if best is None or at < best_at or (at == best_at and len(s) < len(best)):
                best_at, best = at, s
        if best is None:
            self._tail = region[-self._lookback:] if self._lookback else ""
            return None
        cut = best_at + (len(best) if self._include_stop else 0)
        self._drop_pending_suffix(len(region) - cut)
        self._stop_str = best
        self._done = True
        return best

    def _drop_pending_suffix(self, n: int) -> None:
        while n > 0 and self._pending:
            last = self._pending[-1]
            if len(last) <= n:
                self._pending.pop()
                cut = len(last)
            else:
                self._pending[-1] = last[: len(last) - n]
                cut = n
            self._pending_len -= cut
            n -= cut
