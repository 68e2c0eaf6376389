"""RequestStream (engine/request_stream.py): the outputs one API call reads. Outputs of a
request that queue up while the reader is busy come as one, their deltas joined, exactly
as reading them one by one and concatenating would give; nothing else is joined."""

from __future__ import annotations

import asyncio

import pytest

from pagedlm.engine.request_stream import RequestFailedError, RequestStream
from pagedlm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedlm.sampling_params import SamplingParams


class FakeEngine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def check_accepting(self) -> None:
        pass

    def add_stream_requests(self, stream, prompts, params, arrival_time, lora_name):
        loop = asyncio.get_running_loop()
        acks = []
        for _ in prompts:
            ack = loop.create_future()
            ack.set_result(None)
            acks.append(ack)
        return acks

    def abort_stream_requests(self, request_ids) -> None:
        self.aborted.extend(request_ids)


def delta(req: str, step: int, n: int = 1, finished: bool = False, logprobs: bool = False,
          error: str | None = None) -> RequestOutput:
    outputs = [CompletionOutput(
        index=i, text=f"<{req}{i}:{step}>", token_ids=[100 * i + step],
        cumulative_logprob=-float(step + i),
        logprobs=[{100 * i + step: Logprob(-0.5)}] if logprobs else None,
        finish_reason="length" if finished else None) for i in range(n)]
    return RequestOutput(req, "p", [1, 2], outputs, finished,
                         metrics=RequestMetrics(arrival_time=float(step)), error=error)


async def _read(stream: RequestStream) -> list[RequestOutput]:
    return [item async for item in stream]


def _run(requests: list[str], items: list, *, before_reading: int) -> tuple[list, list]:
    """Put `before_reading` items, then read while the rest arrive one per loop turn.
    Returns (what the reader got, the error it ended with or None)."""
    async def main():
        stream = RequestStream(FakeEngine())
        await stream.add_many([(r, "p", [1, 2]) for r in requests], SamplingParams())
        for item in items[:before_reading]:
            stream.put(item)

        async def feed():
            for item in items[before_reading:]:
                await asyncio.sleep(0)
                stream.put(item)

        feeder = asyncio.create_task(feed())
        got, error = [], None
        try:
            async for item in stream:
                got.append(item)
        except RequestFailedError as e:
            error = e
        await feeder
        return got, error

    return asyncio.run(main())


def _joined(outputs: list[RequestOutput]) -> dict:
    """Per request: the concatenated texts, token ids and logprobs of each sequence."""
    seen: dict = {}
    for out in outputs:
        for c in out.outputs:
            text, ids, lps = seen.get((out.request_id, c.index), ("", [], []))
            seen[out.request_id, c.index] = (text + c.text, ids + c.token_ids,
                                            lps + (c.logprobs or []))
    return seen


@pytest.mark.parametrize("n,logprobs", [(1, False), (2, True)])
def test_queued_deltas_come_as_one_equal_to_their_concatenation(n, logprobs):
    items = [delta("a", s, n=n, logprobs=logprobs, finished=s == 5) for s in range(6)]
    one_by_one, _ = _run(["a"], [delta("a", s, n=n, logprobs=logprobs, finished=s == 5)
                                 for s in range(6)], before_reading=0)
    assert len(one_by_one) == 6  # read as they come: nothing to join
    got, error = _run(["a"], items, before_reading=6)
    assert error is None and len(got) == 1
    assert _joined(got) == _joined(one_by_one)
    last = got[0]
    assert last.finished and all(c.finish_reason == "length" for c in last.outputs)
    assert [c.cumulative_logprob for c in last.outputs] == [-5.0 - i for i in range(n)]
    assert last.metrics.arrival_time == 5.0


def test_only_one_requests_consecutive_outputs_are_joined():
    items = [delta("a", 0), delta("a", 1), delta("b", 0), delta("a", 2, finished=True),
             delta("b", 1, finished=True)]
    got, error = _run(["a", "b"], items, before_reading=5)
    assert error is None
    assert [(o.request_id, len(o.outputs[0].token_ids)) for o in got] == [
        ("a", 2), ("b", 1), ("a", 1), ("b", 1)]


def test_nothing_is_joined_past_a_final_output_or_into_an_error():
    items = [delta("a", 0), delta("a", 1, error="boom")]
    got, error = _run(["a"], items, before_reading=2)
    assert [len(o.outputs[0].token_ids) for o in got] == [1]
    assert isinstance(error, RequestFailedError) and "boom" in str(error)
    items = [delta("a", 0, finished=True), delta("b", 0), delta("b", 1, finished=True)]
    got, _ = _run(["a", "b"], items, before_reading=3)
    assert [(o.request_id, o.finished) for o in got] == [("a", True), ("b", True)]


def test_an_error_put_ends_the_stream_after_what_came_before():
    got, error = _run(["a"], [delta("a", 0), delta("a", 1), RequestFailedError("dead")],
                      before_reading=3)
    assert len(got) == 1 and got[0].outputs[0].token_ids == [0, 1]
    assert isinstance(error, RequestFailedError) and str(error) == "dead"
