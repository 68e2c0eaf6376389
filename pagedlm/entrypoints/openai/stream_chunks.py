"""The JSON of the stream chunk that carries one choice's new text and nothing else (no
logprobs, no tool calls, no usage): nearly every chunk a streamed response sends. It is
written from a template here rather than built and dumped as a pydantic model, which cost
more than everything else a token takes on its way through the frontend (about 4.6 us
against 0.1 us per chunk, `timeit` on the Zen 5 VM).

The bytes are those `model_dump_json()` writes for the same chunk (compact separators,
fields in declaration order, non-ASCII characters as they are; a null `usage` left out of a
completion chunk and sent in a chat chunk, as those models do; in a chat delta only the
non-null fields); `tests/server/test_frontend_fast_paths.py` compares
the two on arbitrary text. Chunks of any other shape go through the pydantic models.
"""

from __future__ import annotations

import json

# What pydantic writes for a str: non-ASCII as is, the JSON escapes for '"', '\\' and
# control characters.
_json_str = json.JSONEncoder(ensure_ascii=False).encode


def _json_value(value: int | str | None) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return _json_str(value)
    return str(int(value))


class TextChunkTemplate:
    """Stream chunks of one response (`kind` "completion" or "chat"): `event(index, text,
    finish_reason, stop_reason)` is the SSE event of a chunk with one choice whose only
    news is `text` (for a chat chunk, None leaves the delta empty)."""

    def __init__(self, kind: str, request_id: str, created: int, model: str) -> None:
        obj = {"completion": "text_completion", "chat": "chat.completion.chunk"}[kind]
        self._chat = kind == "chat"
        # A completion chunk leaves a null usage out, a chat chunk sends it.
        self._tail = ',"usage":null}\n\n' if self._chat else "}\n\n"
        self._head = (f'data: {{"id":{_json_str(request_id)},"object":"{obj}",'
                      f'"created":{int(created)},"model":{_json_str(model)},'
                      f'"choices":[{{"index":')

    def event(self, index: int, text: str | None, finish_reason: str | None,
              stop_reason: int | str | None) -> str:
        if self._chat:
            body = '"delta":{}' if text is None else f'"delta":{{"content":{_json_str(text)}}}'
        else:
            body = f'"text":{_json_str(text or "")}'
        return (f'{self._head}{int(index)},{body},"logprobs":null,'
                f'"finish_reason":{_json_value(finish_reason)},'
                f'"stop_reason":{_json_value(stop_reason)}}}]{self._tail}')
