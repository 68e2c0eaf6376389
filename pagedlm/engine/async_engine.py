"""The engine behind the API server: one thread steps the LLMEngine, asyncio talks to it.

    asyncio (event loop thread)                      engine thread
    ---------------------------                      -------------
    await stream.add(...)   -- _Add ------> commands --> engine.add_request()
                            <-- ack (call_soon_threadsafe) --'
    stream.close()          -- _Abort ----> commands --> engine.abort_request()  (blocks freed)
    async for out in stream <-- _deliver(batch) <------- engine.step() -> RequestOutputs

`LLMEngine` is not thread-safe, so only the engine thread ever calls it. It blocks on
the command queue while there is no work and otherwise drains the queue between
steps: a command waits at most one step. The event loop never waits on the engine, so
`/health` answers while a long prefill runs (torch releases the GIL in its kernels).

Outputs are DELTA outputs (only what is new since the last one). The engine thread
publishes a snapshot of `EngineStats` after every step for the metrics endpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.engine.output_processor import RequestOutputKind
from pagedlm.engine.stats import EngineStats
from pagedlm.outputs import RequestOutput
from pagedlm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

OutputListener = Callable[[RequestOutput], None]


class QueueFullError(RuntimeError):
    """The engine's waiting queue is at --max-num-queued-requests."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an unexpected error; no request can be served."""


@dataclass
class _Add:
    stream: RequestStream
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    ack: asyncio.Future


@dataclass
class _Abort:
    request_ids: list[str]


_STOP = object()
_STATS_PERIOD_S = 0.2


class AsyncLLMEngine:
    """Runs an `LLMEngine` on its own thread and serves it to asyncio code.

    Usage (inside a running event loop):
        engine = AsyncLLMEngine(LLMEngine(args)); engine.start()
        stream = engine.open_stream()
        try:
            await stream.add("req-1", prompt, prompt_token_ids, params)
            async for output in stream:   # DELTA RequestOutputs until finished
                ...
        finally:
            stream.close()                # aborts whatever has not finished
    """

    def __init__(self, engine: LLMEngine, max_num_queued_requests: int | None = None) -> None:
        if max_num_queued_requests is not None and max_num_queued_requests < 1:
            raise ValueError(
                f"max_num_queued_requests must be >= 1, got {max_num_queued_requests}")
        self.engine = engine
        self.max_num_queued_requests = max_num_queued_requests
        # SimpleQueue.put is reentrant: RequestStream.__del__ may call it from a GC pass.
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._listeners: list[OutputListener] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Replaced (never mutated) by the engine thread; reading it is atomic.
        self.stats: EngineStats = engine.get_stats()
        self._stats_time = time.monotonic()
        self.dead_error: BaseException | None = None

    # ----- facts about the model, constant after construction ------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def model_path(self) -> str:
        return str(self.engine.model_path)

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and self._thread is not None and self._thread.is_alive()

    # ----- lifecycle ---------------------------------------------------------------------------

    def add_output_listener(self, listener: OutputListener) -> None:
        """Call `listener(output)` on the event loop for every output, aborted ones included
        (metrics use it). Must not raise."""
        self._listeners.append(listener)

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        assert self._thread is None, "the engine thread is already running"
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedlm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._commands.put(_STOP)
        self._thread.join(timeout)
        self.engine.shutdown()  # tensor-parallel ranks, if any

    def open_stream(self) -> RequestStream:
        if self._loop is None:
            raise RuntimeError("AsyncLLMEngine.start() has not been called")
        return RequestStream(self)

    def _submit(self, command: object) -> None:
        self._commands.put(command)

    # ----- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                commands = [] if engine.has_unfinished_requests() else [self._commands.get()]
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                published: list[RequestOutput] = []
                for command in commands:
                    if command is _STOP:
                        return
                    self._apply(command, published)
                if engine.has_unfinished_requests():
                    published.extend(engine.step())
                # The snapshot walks every running request's block table: refresh it on a
                # metrics-scrape time scale while busy, not after every step.
                now = time.monotonic()
                if not engine.has_unfinished_requests() or now - self._stats_time >= _STATS_PERIOD_S:
                    self.stats = engine.get_stats()
                    self._stats_time = now
                if published:
                    self._publish(published)
        except BaseException as e:
            logger.exception("the engine thread stopped on an error")
            self.dead_error = e
            dead = EngineDeadError(f"the engine stopped: {type(e).__name__}: {e}")
            self._call_soon(self._fail_all, list(self._streams.values()), dead)
            # Adds that were queued behind the failure would otherwise wait forever.
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(command, _Add):
                    self._call_soon(_resolve_ack, command.ack, dead)

    def _apply(self, command: object, published: list[RequestOutput]) -> None:
        engine = self.engine
        if isinstance(command, _Abort):
            published.extend(engine.abort_request(command.request_ids))
            return
        assert isinstance(command, _Add)
        error: BaseException | None = None
        limit = self.max_num_queued_requests
        if limit is not None and engine.scheduler.num_waiting >= limit:
            error = QueueFullError(
                f"the server is busy: {engine.scheduler.num_waiting} requests are waiting "
                f"(--max-num-queued-requests {limit}); retry later")
        else:
            try:
                engine.add_request(command.request_id, command.prompt, command.params,
                                   prompt_token_ids=command.prompt_token_ids,
                                   output_kind=RequestOutputKind.DELTA,
                                   arrival_time=command.arrival_time)
                self._streams[command.request_id] = command.stream
            except ValueError as e:
                error = e
            except Exception as e:  # a bug, not bad input: fail this request, keep serving
                logger.exception("add_request(%s) failed", command.request_id)
                error = e
        self._call_soon(_resolve_ack, command.ack, error)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for output in outputs:
            # The engine keeps mutating its RequestMetrics; hand over a frozen copy.
            if output.metrics is not None:
                output.metrics = dataclasses.replace(output.metrics)
            stream = (self._streams.pop(output.request_id, None) if output.finished
                      else self._streams.get(output.request_id))
            batch.append((stream, output))
        self._call_soon(self._deliver, batch)

    def _call_soon(self, fn: Callable, *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed during shutdown: nobody is listening
            pass

    # ----- the event loop side -----------------------------------------------------------------

    def _deliver(self, batch: list[tuple[RequestStream | None, RequestOutput]]) -> None:
        for stream, output in batch:
            for listener in self._listeners:
                listener(output)
            if stream is not None and not stream.closed:
                stream._queue.put_nowait(output)

    @staticmethod
    def _fail_all(streams: list[RequestStream], dead: EngineDeadError) -> None:
        for stream in streams:
            if not stream.closed:
                stream._queue.put_nowait(dead)


def _resolve_ack(ack: asyncio.Future, error: BaseException | None) -> None:
    if ack.done():  # the caller was cancelled while waiting
        return
    if error is None:
        ack.set_result(None)
    else:
        ack.set_exception(error)


class RequestStream:
    """The outputs of the engine requests one API call made (several for a list of prompts).

    Iterating yields every request's DELTA outputs in the order the engine produced them
    and ends when all added requests have finished. `close()` aborts the unfinished ones,
    so the engine frees their KV blocks at its next step; it runs on every exit path of a
    handler (client gone, error, cancellation) and, as a last resort, on garbage collection.
    """

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self._engine = engine
        self._queue: asyncio.Queue = asyncio.Queue()
        self._unfinished: set[str] = set()
        self.closed = False

    async def add(self, request_id: str, prompt: str | None, prompt_token_ids: Sequence[int],
                  params: SamplingParams, arrival_time: float | None = None) -> None:
        """Add a request; returns once the engine accepted it. Raises ValueError for
        invalid input, QueueFullError, EngineDeadError."""
        engine = self._engine
        if self.closed:
            raise RuntimeError("the stream is closed")
        if engine.dead_error is not None:
            raise EngineDeadError(f"the engine stopped: {engine.dead_error!r}")
        assert engine._loop is not None
        ack = engine._loop.create_future()
        # Before submitting: if we are cancelled while waiting, close() still aborts it.
        self._unfinished.add(request_id)
        engine._submit(_Add(self, request_id, prompt, list(prompt_token_ids), params,
                            arrival_time if arrival_time is not None else time.monotonic(), ack))
        try:
            await ack
        except asyncio.CancelledError:
            raise
        except BaseException:
            self._unfinished.discard(request_id)
            raise

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    def close(self) -> None:
        """Abort every request that has not finished. Idempotent; never blocks."""
        self.closed = True
        if self._unfinished:
            self._engine._submit(_Abort(sorted(self._unfinished)))
            self._unfinished.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass
