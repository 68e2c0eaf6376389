"""What one API call gets from the async engine (engine/async_engine.py): a RequestStream
of its requests' outputs, and the errors that stream raises.

The stream asks three things of its engine (StreamEngine): whether new requests are
accepted now, to register and submit its requests, and to abort the ones left when it
closes. The engine hands it outputs, or the error that ends it, with `put()`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from pagedlm.outputs import RequestOutput
from pagedlm.sampling_params import SamplingParams

# (request id, prompt text or None, prompt token ids)
PromptEntry = tuple[str, str | None, list[int]]


class QueueFullError(RuntimeError):
    """The engine's waiting queue is at --max-num-queued-requests."""


class EngineDeadError(RuntimeError):
    """The engine core stopped on an unexpected error; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine ended one request with an error; the others go on. `code` says why:
    "internal_error" (a fault confined to this request), "server_shutting_down"."""

    def __init__(self, message: str, code: str = "internal_error") -> None:
        super().__init__(message)
        self.code = code


class StreamEngine(Protocol):
    """What a RequestStream needs of the engine that opened it (AsyncLLMEngine)."""

    def check_accepting(self) -> None:
        """Raise the error a new request gets now (the engine is dead or refusing), if any."""

    def add_stream_requests(self, stream: RequestStream, prompts: list[PromptEntry],
                            params: SamplingParams, arrival_time: float,
                            lora_name: str | None) -> list[asyncio.Future]:
        """Register and submit one request per prompt, all or none; one ack each."""

    def abort_stream_requests(self, request_ids: list[str]) -> None:
        """Abort requests; safe from any thread (the abort runs on the event loop)."""


class RequestStream:
    """The outputs of the engine requests one API call made (several for a list of prompts).

    Iterating yields every request's DELTA outputs in the order the engine produced them
    and ends when all added requests have finished. `close()` aborts the unfinished ones,
    so the core frees their KV blocks at its next step; it runs on every exit path of a
    handler (client gone, error, cancellation) and, as a last resort, on garbage collection.
    """

    def __init__(self, engine: StreamEngine) -> None:
        self._engine = engine
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()  # set while _items holds something
        self._unfinished: set[str] = set()
        # request id -> its place among the requests added to this stream (an API call's
        # prompt index), so callers never parse structure back out of ids
        self.index_of: dict[str, int] = {}
        self.closed = False

    async def add(self, request_id: str, prompt: str | None, prompt_token_ids: Sequence[int],
                  params: SamplingParams, arrival_time: float | None = None) -> None:
        """Add a request; returns once the core accepted it. Raises ValueError for
        invalid input, QueueFullError, EngineDeadError."""
        await self.add_many([(request_id, prompt, prompt_token_ids)], params, arrival_time)

    async def add_many(self, prompts: Sequence[tuple[str, str | None, Sequence[int]]],
                       params: SamplingParams, arrival_time: float | None = None,
                       lora_name: str | None = None) -> None:
        """Add one request per (request_id, prompt text or None, prompt token ids), all
        or none: if the queue cannot take them all, none is queued (QueueFullError).
        `lora_name`: an adapter added with `add_lora` (None: the base model)."""
        engine = self._engine
        if self.closed:
            raise RuntimeError("the stream is closed")
        engine.check_accepting()
        entries = [(request_id, prompt, list(ids)) for request_id, prompt, ids in prompts]
        acks = engine.add_stream_requests(
            self, entries, params, arrival_time if arrival_time is not None else time.monotonic(),
            lora_name)
        # Before waiting: if we are cancelled while waiting, close() still aborts them.
        for request_id, _, _ in entries:
            self._unfinished.add(request_id)
            self.index_of[request_id] = len(self.index_of)
        await asyncio.wait(acks)
        errors = [ack.exception() for ack in acks if ack.exception() is not None]
        if errors:
            for request_id, _, _ in entries:
                self._unfinished.discard(request_id)
            raise errors[0]

    def put(self, item: RequestOutput | BaseException) -> None:
        """The engine's side (event loop only): an output, or the error that ends the
        stream."""
        self._items.append(item)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        """The next output. Outputs of one request that queued up while the consumer was
        busy (a server behind the engine under load) come as one, their deltas joined, as
        vLLM's output collector does: one response chunk to build and send for several
        steps' tokens, instead of one per step."""
        if not self._unfinished:
            raise StopAsyncIteration
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        while (self._items and isinstance(item, RequestOutput)
               and _join_delta(item, self._items[0])):
            self._items.popleft()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        if item.error is not None:  # this request failed alone; close() aborts the others
            raise RequestFailedError(item.error)
        return item

    def close(self) -> None:
        """Abort every request that has not finished. Idempotent; never blocks; safe from
        any thread (the abort runs on the event loop)."""
        self.closed = True
        if self._unfinished:
            ids = sorted(self._unfinished)
            self._unfinished.clear()
            self._engine.abort_stream_requests(ids)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def _join_delta(first: RequestOutput, then: object) -> bool:
    """Append the DELTA output `then` to `first` when both are the same request's and can
    be one (same sequences, `first` not final, `then` no error); False leaves both as
    they are. Texts, token ids and logprobs are joined; the rest is `then`'s."""
    if (not isinstance(then, RequestOutput) or then.request_id != first.request_id
            or first.finished or first.error is not None or then.error is not None
            or [c.index for c in first.outputs] != [c.index for c in then.outputs]
            or (then.prompt_logprobs is not None and first.prompt_logprobs is not None)):
        return False
    for into, more in zip(first.outputs, then.outputs):
        into.text += more.text
        into.token_ids = into.token_ids + more.token_ids
        if more.logprobs is not None:
            into.logprobs = (into.logprobs or []) + more.logprobs
        into.cumulative_logprob = more.cumulative_logprob
        into.finish_reason, into.stop_reason = more.finish_reason, more.stop_reason
    if then.prompt_logprobs is not None:
        first.prompt_logprobs = then.prompt_logprobs
    first.finished = then.finished
    first.metrics = then.metrics
    first.num_cached_tokens = max(first.num_cached_tokens, then.num_cached_tokens)
    first.extra.update(then.extra)
    return True
