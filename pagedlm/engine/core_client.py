"""An EngineCore behind a command queue: the commands and messages that cross to and from
it, the loop that applies the commands between steps, and ThreadCoreClient, which runs
that loop on a thread of this process. ProcessCoreClient (engine/core_process.py) runs the
same loop in a process of its own.

    frontend (event loop)                           core loop (a thread, or the core process)
    ---------------------                           ------------------------------------------
    submit(Add | Abort | Finish)  -> SimpleQueue -------------> commands applied
    on_message(CoreMessage)       <---------------------------- one CoreMessage per step:
                                                                acks, every request's new
                                                                tokens, a stats snapshot,
                                                                the dashboard's if watched

Commands wait at most one step: the loop drains them between steps and blocks on them only
while it has no work. Everything in a command or a message is token ids and small
dataclasses, picklable, so that the loop can run on the far side of a pipe.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedlm.engine.core import EngineCore
from pagedlm.engine.core_io import CoreBeamRequest, CoreInfo, CoreOutputs, CoreRequest
from pagedlm.engine.dashboard import SNAPSHOT_PERIOD_S, DashboardSnapshot
from pagedlm.engine.stats import EngineStats
from pagedlm.lora.request import LoRARequest

logger = logging.getLogger(__name__)

_STATS_PERIOD_S = 0.2


@dataclass
class AddCommand:
    """Queue requests, all or none (the prompts of one API call)."""

    requests: list[CoreRequest | CoreBeamRequest]

    def __init__(self, *requests: CoreRequest | CoreBeamRequest) -> None:
        self.requests = list(requests)


def num_sequences(request: CoreRequest | CoreBeamRequest) -> int:
    """What a request adds to the waiting queue: its samples (n, or best_of), its beams."""
    if isinstance(request, CoreRequest):
        return len(request.seeds)
    return request.params.beam_width


@dataclass
class AbortCommand:
    request_ids: list[str]


@dataclass
class FinishCommand:
    seq_ids: list[str]  # a stop string matched


@dataclass
class DashboardCommand:
    """watch=+1: a dashboard opened, -1: one closed (snapshots come every
    SNAPSHOT_PERIOD_S while any is open and the engine is busy); 0: one snapshot now."""

    watch: int = 0


@dataclass
class LoRACommand:
    """Add an adapter (`add`) or forget one by name (`remove`); acked under `command_id`:
    "invalid" with the reason if it cannot be added, "not_found" if there is no such
    adapter to remove."""

    command_id: str
    add: LoRARequest | None = None
    remove: str | None = None


@dataclass
class ShutdownCommand:
    pass


@dataclass
class Ack:
    request_id: str
    error_kind: str | None = None  # None: accepted; "invalid", "queue_full", "internal"
    message: str = ""


@dataclass
class CoreMessage:
    acks: list[Ack] = field(default_factory=list)
    outputs: CoreOutputs | None = None
    stats: EngineStats | None = None
    dashboard: DashboardSnapshot | None = None
    dead: str | None = None  # the core stopped on this error; nothing more will come


MessageHandler = Callable[[CoreMessage], None]


def run_core_loop(core: EngineCore, recv: Callable[[bool], list], send: MessageHandler,
                  max_num_queued_requests: int | None) -> None:
    """Apply commands and step until a ShutdownCommand. `recv(block)` returns the queued
    commands (at least one when `block`); `send` publishes a message. The loop runs in
    inference mode, entered once (the thread or process is the loop's own)."""
    with torch.inference_mode():
        _core_loop(core, recv, send, max_num_queued_requests)


def _core_loop(core: EngineCore, recv: Callable[[bool], list], send: MessageHandler,
               max_num_queued_requests: int | None) -> None:
    stats_time = snapshot_time = 0.0
    watchers = 0  # dashboards open
    while True:
        commands = recv(not core.has_unfinished_requests())
        message = CoreMessage()
        snapshot_now = False
        for command in commands:
            if isinstance(command, ShutdownCommand):
                return
            if isinstance(command, DashboardCommand):
                watchers = max(0, watchers + command.watch)
                snapshot_now = True
                continue
            _apply(core, command, message, max_num_queued_requests)
        if core.has_unfinished_requests():
            outputs = core.step()
            if outputs:
                message.outputs = outputs
        # The snapshot walks every running request's block table: refresh it on a
        # metrics-scrape time scale while busy (and when requests come or go), not after
        # every step.
        now = time.monotonic()
        if (commands or not core.has_unfinished_requests()
                or now - stats_time >= _STATS_PERIOD_S):
            message.stats = core.get_stats()
            stats_time = now
        # At most one snapshot per step, and none unless someone watches or asked.
        if snapshot_now or (watchers and (now - snapshot_time >= SNAPSHOT_PERIOD_S
                                          or not core.has_unfinished_requests())):
            message.dashboard = core.dashboard_snapshot(message.stats)
            snapshot_time = now
        if (message.acks or message.outputs is not None or message.stats is not None
                or message.dashboard is not None):
            send(message)


def _apply(core: EngineCore, command: object, message: CoreMessage,
           max_num_queued_requests: int | None) -> None:
    if isinstance(command, AbortCommand):
        core.abort_requests(command.request_ids)
    elif isinstance(command, FinishCommand):
        core.finish_sequences(command.seq_ids)
    elif isinstance(command, AddCommand):
        _add_all(core, command.requests, message, max_num_queued_requests)
    elif isinstance(command, LoRACommand):
        message.acks.append(_apply_lora(core, command))
    else:
        raise TypeError(f"unknown core command {command!r}")


def _add_all(core: EngineCore, requests: list[CoreRequest | CoreBeamRequest],
             message: CoreMessage, max_num_queued_requests: int | None) -> None:
    """Queue every request or none; one ack per request either way."""
    ids = [r.request_id for r in requests]

    def reject(kind: str, text: str) -> None:
        message.acks.extend(Ack(request_id, kind, text) for request_id in ids)

    limit = max_num_queued_requests
    if limit is not None:
        waiting = core.num_waiting_sequences()
        needed = sum(num_sequences(r) for r in requests)
        if waiting + needed > limit:
            reject("queue_full", f"the server is busy: {waiting} sequences are waiting and this "
                   f"request adds {needed} (--max-num-queued-requests {limit}); retry later")
            return
    added: list[str] = []
    try:
        for request in requests:
            if isinstance(request, CoreBeamRequest):
                core.add_beam_request(request)
            else:
                core.add_request(request)
            added.append(request.request_id)
    except ValueError as e:
        core.abort_requests(added)
        reject("invalid", str(e))
    except Exception as e:  # a bug, not bad input: fail this request, keep serving
        logger.exception("add_request(%s) failed", ", ".join(ids))
        core.abort_requests(added)
        reject("internal", f"{type(e).__name__}: {e}")
    else:
        message.acks.extend(Ack(request_id) for request_id in ids)


def _apply_lora(core: EngineCore, command: LoRACommand) -> Ack:
    if command.add is not None:
        try:
            core.loras.add(command.add)
        except ValueError as e:
            return Ack(command.command_id, "invalid", str(e))
    elif not core.loras.remove(command.remove):
        return Ack(command.command_id, "not_found",
                   f"there is no LoRA adapter named {command.remove!r}")
    return Ack(command.command_id)


def drain(commands: queue.SimpleQueue, block: bool) -> list:
    """The queued commands, waiting for one first if `block`."""
    items = [commands.get()] if block else []
    while True:
        try:
            items.append(commands.get_nowait())
        except queue.Empty:
            return items


class ThreadCoreClient:
    """The core stepped by a thread of this process (the GIL is shared with the caller)."""

    def __init__(self, core: EngineCore, max_num_queued_requests: int | None = None) -> None:
        self.core = core
        self.info: CoreInfo = core.info
        self.initial_stats = core.get_stats()
        self._max_num_queued_requests = max_num_queued_requests
        # SimpleQueue.put is reentrant: a RequestStream.__del__ may submit from a GC pass.
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, on_message: MessageHandler) -> None:
        assert self._thread is None, "the core thread is already running"
        self._thread = threading.Thread(target=self._run, args=(on_message,),
                                        name="pagedlm-engine-core", daemon=True)
        self._thread.start()

    def _run(self, on_message: MessageHandler) -> None:
        try:
            run_core_loop(self.core, lambda block: drain(self._commands, block), on_message,
                          self._max_num_queued_requests)
        except BaseException as e:
            logger.exception("the engine core thread stopped on an error")
            on_message(CoreMessage(dead=f"{type(e).__name__}: {e}"))

    def submit(self, command: object) -> None:
        self._commands.put(command)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._commands.put(ShutdownCommand())
            self._thread.join(timeout)
        self.core.shutdown()  # tensor-parallel ranks, if any
