"""ToolCallParser: one choice's generated text in, new content and tool-call deltas out.

One parser serves streaming and whole responses: a whole response is the stream fed at
once, so the two always agree. The parser re-reads the text it has so far on every delta
and sends only what is new and can no longer change: content up to a possible start of a
call (a held-back `<tool_ca` or trailing whitespace), a call's id and name once its name
is complete, then its arguments as the raw JSON text grows. The arguments string is the
model's own text of the arguments object, byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedlm.entrypoints.openai.tool_parsers.formats import ToolCallFormat
from pagedlm.entrypoints.openai.tool_parsers.json_scan import (
    WS,
    CallScan,
    find_outside_strings,
    scan_calls,
)


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str


@dataclass
class ToolCallDelta:
    """One piece of a streamed call: the first carries id and name, the rest arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest proper prefix of `marker` that `text` ends with."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _held_suffix(segment: str, marker: str) -> int:
    """How many trailing characters of a content segment to hold back: a partial start
    marker and the whitespace before it (a call may follow, and the whitespace before a
    call is not content)."""
    keep = len(segment) - _partial_marker(segment, marker)
    while keep > 0 and segment[keep - 1] in WS:
        keep -= 1
    return len(segment) - keep


@dataclass
class _Analysis:
    content: str
    calls: list[CallScan]


@dataclass
class ToolCallParser:
    """Feeds on one choice's generated text; returns what is new for the client."""

    format: ToolCallFormat
    text: str = ""
    finished: bool = False
    _sent_content: int = 0
    _ids: list[str] = field(default_factory=list)
    _sent_arguments: list[int] = field(default_factory=list)
    _calls: list[CallScan] = field(default_factory=list)

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """New content text and call deltas after `delta` is appended."""
        self.text += delta
        return self._update(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The rest, once the output is complete (held-back text, a call cut short)."""
        self.finished = True
        return self._update(final=True)

    @property
    def tool_calls(self) -> list[ParsedToolCall]:
        """The calls so far (after finish(): all of them)."""
        return [ParsedToolCall(self._ids[i], call.name or "",
                               self._arguments(call, self.finished))
                for i, call in enumerate(self._calls[:len(self._ids)])]

    @staticmethod
    def _arguments(call: CallScan, final: bool) -> str:
        if final and not call.arguments and call.complete:
            return "{}"
        return call.arguments

    def _update(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        analysis = self._analyse(final)
        content = analysis.content[self._sent_content:]
        self._sent_content = len(analysis.content)
        deltas: list[ToolCallDelta] = []
        self._calls = analysis.calls
        for i, call in enumerate(analysis.calls):
            if call.name is None:
                break  # later calls wait for this one's name: indexes stay in order
            if i == len(self._ids):
                self._ids.append(self.format.new_id())
                self._sent_arguments.append(0)
                deltas.append(ToolCallDelta(i, id=self._ids[i], name=call.name, arguments=""))
            arguments = self._arguments(call, final)
            if not call.arguments_done and not arguments.startswith(("{", "[")):
                continue  # a string or scalar: sent whole once complete
            new = arguments[self._sent_arguments[i]:]
            if new:
                self._sent_arguments[i] = len(arguments)
                if deltas and deltas[-1].index == i and deltas[-1].arguments == "":
                    deltas[-1].arguments = new
                else:
                    deltas.append(ToolCallDelta(i, arguments=new))
        return content, deltas

    def _analyse(self, final: bool) -> _Analysis:
        fmt, text = self.format, self.text
        if fmt.start is None:
            return self._analyse_json_output(final)
        content: list[str] = []
        calls: list[CallScan] = []
        pos, after_call = 0, False
        while True:
            start = text.find(fmt.start, pos)
            segment = text[pos:] if start < 0 else text[pos:start]
            if after_call:
                segment = segment.lstrip(WS)
            if start < 0:
                held = 0 if final else _held_suffix(segment, fmt.start)
                content.append(segment[:len(segment) - held])
                return _Analysis("".join(content), calls)
            body_start = start + len(fmt.start)
            end = find_outside_strings(text, fmt.end, body_start) if fmt.end else -1
            closed = end >= 0 or final
            body = text[body_start:] if end < 0 else text[body_start:end]
            if not closed and fmt.end:
                # an end marker may be arriving: keep its first characters out of the body
                body = body[:len(body) - _partial_marker(body, fmt.end)]
            found = scan_calls(body)
            named = [c for c in found if c.name is not None]
            if named:
                content.append(segment.rstrip(WS))  # the whitespace before a call goes
                calls.extend(named if closed else found)
            elif end < 0 and final and body.lstrip(WS).startswith(("{", "[")):
                content.append(segment.rstrip(WS))  # a call cut short before its name
            elif closed:  # a region without a call in it was text after all
                content.append(segment)
                content.append(text[start:] if end < 0 else text[start:end + len(fmt.end)])
            else:  # undecided yet: hold the whitespace before it too
                content.append(segment.rstrip(WS))
                return _Analysis("".join(content), calls)
            if end < 0:
                return _Analysis("".join(content), calls)
            pos, after_call = end + len(fmt.end), bool(named)

    def _analyse_json_output(self, final: bool) -> _Analysis:
        """Llama 3's JSON format: the whole output is calls if it starts with '{'."""
        text = self.text
        body = text.lstrip(WS)
        tagged = body.startswith("<|python_tag|>")
        if tagged:
            body = body[len("<|python_tag|>"):].lstrip(WS)
        if not body or (not tagged and "<|python_tag|>".startswith(body)):
            return _Analysis(text if final else "", [])  # undecided yet
        if not body.startswith("{"):
            return _Analysis(text, [])
        found = scan_calls(body)
        if any(c.name is not None for c in found):
            return _Analysis("", found if not final else [c for c in found if c.name])
        return _Analysis(text if final else "", [])
