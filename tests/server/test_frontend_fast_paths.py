"""The frontend's per-token fast paths equal what they replace: the hand-written stream
chunks (entrypoints/openai/stream_chunks.py) are the bytes the pydantic models write for
the same chunk, whatever the text; a RequestMetrics snapshot is dataclasses.replace's copy."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedlm.entrypoints.openai.protocol.chat import (
    ChatChunkChoice,
    ChatCompletionChunk,
    DeltaMessage,
)
from pagedlm.entrypoints.openai.protocol.completion import CompletionChoice, CompletionResponse
from pagedlm.entrypoints.openai.sse import sse_event
from pagedlm.entrypoints.openai.stream_chunks import TextChunkTemplate

TEXTS = ["", " hello", 'say "hi"\n', "back\\slash\ttab", "\x00\x01\x1f\x7f", "naïve café 東京 🎉",
         "\u2028\u2029", "</script>", "\ufffd"]
IDS = ["cmpl-0", 'odd "id" \\ é']
REASONS = [(None, None), ("length", None), ("stop", None), ("stop", 2), ("stop", "\n\nUser:"),
           ("abort", None)]


def _completion(request_id, created, model, index, text, finish, stop):
    chunk = CompletionResponse(id=request_id, created=created, model=model, choices=[
        CompletionChoice(index=index, text=text, logprobs=None, finish_reason=finish,
                         stop_reason=stop)])
    return sse_event(chunk.model_dump_json())


def _chat(request_id, created, model, index, text, finish, stop):
    chunk = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[
        ChatChunkChoice(index=index, delta=DeltaMessage(content=text), logprobs=None,
                        finish_reason=finish, stop_reason=stop)])
    return sse_event(chunk.model_dump_json())


def test_completion_chunks_equal_pydantic():
    for request_id in IDS:
        template = TextChunkTemplate("completion", request_id, 1764288000, "smol/é")
        for text in TEXTS:
            for finish, stop in REASONS:
                for index in (0, 3):
                    assert template.event(index, text, finish, stop) == _completion(
                        request_id, 1764288000, "smol/é", index, text, finish, stop)


def test_chat_chunks_equal_pydantic():
    for request_id in IDS:
        template = TextChunkTemplate("chat", request_id, 7, "m")
        for text in [None, *TEXTS[1:]]:
            for finish, stop in REASONS:
                assert template.event(1, text, finish, stop) == _chat(
                    request_id, 7, "m", 1, text, finish, stop)


@settings(max_examples=300, deadline=None)
@given(text=st.text(), model=st.text(min_size=1), created=st.integers(0, 2**40),
       stop=st.none() | st.integers(0, 2**31) | st.text(min_size=1))
def test_any_text_equals_pydantic(text, model, created, stop):
    completion = TextChunkTemplate("completion", "cmpl-x", created, model)
    assert completion.event(0, text, "stop", stop) == _completion(
        "cmpl-x", created, model, 0, text, "stop", stop)
    chat = TextChunkTemplate("chat", "chatcmpl-x", created, model)
    assert chat.event(0, text or None, None, stop) == _chat(
        "chatcmpl-x", created, model, 0, text or None, None, stop)


def test_metrics_snapshot_is_an_equal_independent_copy():
    import dataclasses

    from pagedlm.outputs import RequestMetrics

    metrics = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.5, first_token_time=2.0,
                             last_token_time=2.5, num_preemptions=1)
    copy = metrics.snapshot()
    assert copy == dataclasses.replace(metrics) and copy is not metrics
    metrics.last_token_time, metrics.finished_time = 3.0, 3.5
    assert copy.last_token_time == 2.5 and copy.finished_time is None
    assert copy.time_to_first_token == 1.0 and copy.time_in_queue == 0.5
