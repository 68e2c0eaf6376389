"""The engine behind the API server: a frontend on the event loop, the core elsewhere.

    event loop (this process)                          core (its own process, or a thread)
    -------------------------                          ------------------------------------
    await stream.add(...)  validate, register -- Add ----> core.add_request()
                           <------------------- ack ------'
    stream.close()         abort output       -- Abort --> core.abort_requests() (blocks freed)
    async for out in stream  <- frontend.process(message) <-- one message per core step
                             stop string matched -- Finish --> core.finish_sequences()

`AsyncLLMEngine.from_engine_args(args)` puts the core in a process of its own (what
`pagedlm serve` runs): HTTP, JSON, tokenisation, detokenisation and stop strings never
take the GIL from the model step. `AsyncLLMEngine(llm_engine)` steps an existing
LLMEngine's core on a thread of this process instead.

Every frontend structure is touched by the event loop thread only: messages from the core
arrive on a receiver thread and are handed over with `call_soon_threadsafe`. The event
loop never waits on the core, so `/health` answers during a long prefill. Outputs are
DELTA outputs (only what is new since the last one). The streams, and the errors they
raise, are engine/request_stream.py's.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from pagedlm.config import EngineArgs
from pagedlm.engine.core_client import (
    AbortCommand,
    AddCommand,
    CoreMessage,
    DashboardCommand,
    FinishCommand,
    LoRACommand,
    ThreadCoreClient,
)
from pagedlm.engine.core_launch import CoreLaunch, launch_core
from pagedlm.engine.core_process import ProcessCoreClient
from pagedlm.engine.dashboard import DashboardSnapshot
from pagedlm.engine.frontend import EngineFrontend
from pagedlm.engine.llm_engine import LLMEngine, load_frontend_parts
from pagedlm.engine.output_processor import RequestOutputKind
from pagedlm.engine.request_stream import (
    EngineDeadError,
    PromptEntry,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from pagedlm.engine.stats import EngineStats
from pagedlm.lora.request import LoRARequest
from pagedlm.outputs import RequestOutput
from pagedlm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

OutputListener = Callable[[RequestOutput], None]


class AsyncLLMEngine:
    """Serves an engine core to asyncio code.

    Usage (inside a running event loop):
        engine = AsyncLLMEngine.from_engine_args(args); engine.start()
        stream = engine.open_stream()
        try:
            await stream.add("req-1", prompt, prompt_token_ids, params)
            async for output in stream:   # DELTA RequestOutputs until finished
                ...
        finally:
            stream.close()                # aborts whatever has not finished
    """

    def __init__(self, engine: LLMEngine | None = None,
                 max_num_queued_requests: int | None = None, *,
                 _client: ProcessCoreClient | None = None,
                 _frontend: EngineFrontend | None = None, _model_path: str = "") -> None:
        if max_num_queued_requests is not None and max_num_queued_requests < 1:
            raise ValueError(
                f"max_num_queued_requests must be >= 1, got {max_num_queued_requests}")
        if engine is not None:
            self.client: ThreadCoreClient | ProcessCoreClient = ThreadCoreClient(
                engine.core, max_num_queued_requests)
            self.frontend = engine.frontend
            self.model_path = str(engine.model_path)
        else:
            assert _client is not None and _frontend is not None
            self.client, self.frontend, self.model_path = _client, _frontend, _model_path
        self.max_num_queued_requests = max_num_queued_requests
        self._streams: dict[str, RequestStream] = {}
        self._acks: dict[str, asyncio.Future] = {}
        self._listeners: list[OutputListener] = []
        self._dead_listeners: list[Callable[[], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self.stats: EngineStats = self.client.initial_stats
        self._stats_listeners: list[Callable[[EngineStats], None]] = []
        # The latest dashboard snapshot (engine/dashboard.py), and who wants each new one.
        self.dashboard: DashboardSnapshot | None = None
        self._dashboard_listeners: list[Callable[[DashboardSnapshot], None]] = []
        # LoRA adapters the core has accepted, by name (requests name them as their model).
        self.lora_requests: dict[str, LoRARequest] = {}
        self._next_lora_id = 1
        self.dead_error: EngineDeadError | None = None
        # Set by fail_requests(): new requests get this error too.
        self._refusal: RequestFailedError | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, max_num_queued_requests: int | None = None,
                         launch: CoreLaunch | None = None) -> AsyncLLMEngine:
        """Start the core in its own process (or take over `launch`, one started already
        for `args`), load the tokenizer here meanwhile, and build the frontend for it."""
        if max_num_queued_requests is not None and max_num_queued_requests < 1:
            raise ValueError(
                f"max_num_queued_requests must be >= 1, got {max_num_queued_requests}")
        if launch is None:
            launch = launch_core(args, max_num_queued_requests)
        try:
            source, tokenizer, eos_ids = load_frontend_parts(args)
        except BaseException:
            launch.abandon()
            raise
        client = ProcessCoreClient(args, eos_ids, max_num_queued_requests, launch)
        frontend = EngineFrontend(tokenizer, client.info, args.seed)
        return cls(None, max_num_queued_requests, _client=client, _frontend=frontend,
                   _model_path=str(source.path))

    # ----- facts about the model, constant after construction ------------------------------

    @property
    def tokenizer(self):
        return self.frontend.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.frontend.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.frontend.info.vocab_size

    @property
    def device(self) -> str:
        return self.frontend.info.device

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and self._started and self.client.is_alive()

    # ----- lifecycle ---------------------------------------------------------------------------

    def add_output_listener(self, listener: OutputListener) -> None:
        """Call `listener(output)` on the event loop for every output, aborted ones included
        (metrics use it). Must not raise."""
        self._listeners.append(listener)

    def add_stats_listener(self, listener: Callable[[EngineStats], None]) -> None:
        """Call `listener(stats)` on the event loop for every stats refresh from the core
        (every 0.2 s while busy, and when requests come or go)."""
        self._stats_listeners.append(listener)

    def add_dashboard_listener(self, listener: Callable[[DashboardSnapshot], None]) -> None:
        """Call `listener(snapshot)` on the event loop for every dashboard snapshot."""
        self._dashboard_listeners.append(listener)

    def watch_dashboard(self, delta: int) -> None:
        """+1: a dashboard opened (snapshots stream while any is open), -1: one closed,
        0: one snapshot now. Safe from the event loop only."""
        if self.dead_error is None:
            self.client.submit(DashboardCommand(delta))

    def add_dead_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` on the event loop once, if the core dies."""
        self._dead_listeners.append(listener)

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        assert not self._started, "the engine is already running"
        self._loop = loop or asyncio.get_running_loop()
        self._started = True
        if isinstance(self.client, ProcessCoreClient):
            self.client.start(self._on_message, self._loop)  # read on the loop itself
        else:
            self.client.start(self._on_message_threadsafe)

    def shutdown(self) -> None:
        self.client.shutdown()

    def open_stream(self) -> RequestStream:
        if self._loop is None:
            raise RuntimeError("AsyncLLMEngine.start() has not been called")
        return RequestStream(self)

    # ----- the event loop side -----------------------------------------------------------------

    def _call_soon(self, fn: Callable, *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed during shutdown: nobody is listening
            pass

    def _on_message_threadsafe(self, message: CoreMessage) -> None:
        self._call_soon(self._on_message, message)

    def _on_message(self, message: CoreMessage) -> None:
        frontend = self.frontend
        for ack in message.acks:
            future = self._acks.pop(ack.request_id, None)
            if ack.error_kind is not None:
                frontend.forget(ack.request_id)
                self._streams.pop(ack.request_id, None)
            if future is None or future.done():  # the caller was cancelled while waiting
                continue
            if ack.error_kind is None:
                future.set_result(None)
            elif ack.error_kind == "invalid":
                future.set_exception(ValueError(ack.message))
            elif ack.error_kind == "queue_full":
                future.set_exception(QueueFullError(ack.message))
            elif ack.error_kind == "not_found":
                future.set_exception(LookupError(ack.message))
            else:
                future.set_exception(RuntimeError(ack.message))
        if message.stats is not None:
            self.stats = message.stats
            for stats_listener in self._stats_listeners:
                stats_listener(message.stats)
        if message.dashboard is not None:
            self.dashboard = message.dashboard
            for dashboard_listener in self._dashboard_listeners:
                dashboard_listener(message.dashboard)
        if message.outputs is not None:
            outputs, stopped, failed = frontend.process(message.outputs)
            if stopped:
                self.client.submit(FinishCommand(stopped))
            if failed:
                self.client.submit(AbortCommand(failed))
            self._deliver(outputs)
        if message.dead is not None:
            self._die(message.dead)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        streams = self._streams
        for output in outputs:
            if output.metrics is not None:  # the frontend keeps updating its own copy
                output.metrics = output.metrics.snapshot()
            for listener in self._listeners:
                listener(output)
            stream = (streams.pop(output.request_id, None) if output.finished
                      else streams.get(output.request_id))
            if stream is not None and not stream.closed:
                stream.put(output)

    def _die(self, reason: str) -> None:
        if self.dead_error is not None:
            return
        logger.error("the engine core stopped: %s", reason)
        self.dead_error = EngineDeadError(f"the engine stopped: {reason}")
        for future in self._acks.values():
            if not future.done():
                future.set_exception(self.dead_error)
        self._acks.clear()
        for stream in self._streams.values():
            if not stream.closed:
                stream.put(self.dead_error)
        self._streams.clear()
        for listener in self._dead_listeners:
            listener()

    def fail_requests(self, error: RequestFailedError) -> int:
        """End every request in flight with `error` (each stream raises it), free their KV
        blocks, and refuse new requests with it from now on (a server's drain deadline).
        Returns how many requests were ended. Event loop only."""
        self._refusal = error
        ids = list(self._streams)
        for stream in set(self._streams.values()):
            if not stream.closed:
                stream.put(error)
        for future in self._acks.values():
            if not future.done():
                future.set_exception(error)
        self._acks.clear()
        if ids:
            self._abort(ids)
        return len(ids)

    # ----- LoRA adapters (event loop only) ----------------------------------------------------

    @property
    def lora_enabled(self) -> bool:
        return self.client.info.lora_enabled

    async def add_lora(self, lora_name: str, lora_path: str) -> LoRARequest:
        """Have the core read and check an adapter; requests may then name it. Raises
        ValueError saying what is wrong with it (nothing changes then)."""
        if lora_name in self.lora_requests:
            raise ValueError(f"a LoRA adapter named {lora_name!r} is already loaded; unload "
                             "it first")
        lora_request = LoRARequest(lora_name, self._next_lora_id, lora_path)
        self._next_lora_id += 1
        await self._lora_command(add=lora_request)
        self.lora_requests[lora_name] = lora_request
        return lora_request

    async def remove_lora(self, lora_name: str) -> None:
        """Forget an adapter (requests using it finish with it). LookupError if unknown."""
        await self._lora_command(remove=lora_name)
        self.lora_requests.pop(lora_name, None)

    async def _lora_command(self, **what) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        assert self._loop is not None, "AsyncLLMEngine.start() has not been called"
        command_id = f"lora-command-{uuid.uuid4().hex}"
        ack = self._loop.create_future()
        self._acks[command_id] = ack
        self.client.submit(LoRACommand(command_id, **what))
        await ack

    # ----- what a RequestStream asks of its engine (request_stream.StreamEngine) -------------

    def check_accepting(self) -> None:
        """Raise the error new requests get now: the core is dead, or fail_requests() ran."""
        if self.dead_error is not None:
            raise self.dead_error
        if self._refusal is not None:
            raise self._refusal

    def add_stream_requests(self, stream: RequestStream, prompts: list[PromptEntry],
                            params: SamplingParams, arrival_time: float,
                            lora_name: str | None = None) -> list[asyncio.Future]:
        """Register and submit one request per (request_id, prompt, token ids), all or none:
        the core queues them together or rejects them together."""
        requests = []
        try:
            for request_id, prompt, prompt_token_ids in prompts:
                requests.append(self.frontend.make_request(
                    request_id, prompt, params, prompt_token_ids, RequestOutputKind.DELTA,
                    arrival_time, lora_name=lora_name))
        except BaseException:
            for request in requests:
                self.frontend.forget(request.request_id)
            raise
        assert self._loop is not None
        acks = []
        for request in requests:
            ack = self._loop.create_future()
            self._acks[request.request_id] = ack
            self._streams[request.request_id] = stream
            acks.append(ack)
        self.client.submit(AddCommand(*requests))
        return acks

    def abort_stream_requests(self, request_ids: list[str]) -> None:
        self._call_soon(self._abort, request_ids)

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._streams.pop(request_id, None)
        self._deliver(self.frontend.abort(request_ids))
        self.client.submit(AbortCommand(request_ids))
