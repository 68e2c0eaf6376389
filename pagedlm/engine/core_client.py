"""An EngineCore behind a command queue: on a thread of this process, or in a process of
its own so that HTTP, tokenisation and detokenisation never hold the core's GIL.

    frontend (event loop)                           core loop (a thread, or the core process)
    ---------------------                           ------------------------------------------
    submit(Add | Abort | Finish)  -> SimpleQueue --[sender thread, pipe]--> commands applied
    on_message(CoreMessage)       <--[receiver thread, pipe]-- one CoreMessage per step:
                                                                acks, every request's new
                                                                tokens, a stats snapshot,
                                                                the dashboard's if watched

Commands wait at most one step: the loop drains them between steps and blocks on them only
while it has no work. Everything crossing the pipe is token ids and small dataclasses,
pickled; one message carries a whole step. The core process dies with its parent (the
pipe's end or PR_SET_PDEATHSIG), and the parent sees the core's death at once (the pipe
closes), whatever killed it.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedlm.config import EngineArgs
from pagedlm.engine.core import EngineCore
from pagedlm.engine.core_io import CoreBeamRequest, CoreInfo, CoreOutputs, CoreRequest
from pagedlm.engine.dashboard import SNAPSHOT_PERIOD_S, DashboardSnapshot
from pagedlm.engine.stats import EngineStats
from pagedlm.lora.request import LoRARequest

logger = logging.getLogger(__name__)

_STATS_PERIOD_S = 0.2
_SHUTDOWN_TIMEOUT_S = 20.0


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
    commands (at least one when `block`); `send` publishes a message."""
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


def _drain(commands: queue.SimpleQueue, block: bool) -> list:
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
            run_core_loop(self.core, lambda block: _drain(self._commands, block), on_message,
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


class CoreProcessError(RuntimeError):
    """The core process could not start."""


class ProcessCoreClient:
    """The core in a process of its own, started here and loaded before this returns.
    Raises ValueError for bad engine arguments (as the in-process engine would)."""

    def __init__(self, args: EngineArgs, eos_token_ids: tuple[int, ...],
                 max_num_queued_requests: int | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=core_process_main, name="pagedlm-engine-core",
            args=(child_conn, args, eos_token_ids, max_num_queued_requests,
                  (logging.getLogger().level, logging.getLogger("pagedlm").getEffectiveLevel())))
        self.process.start()
        child_conn.close()
        try:
            ready = self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise CoreProcessError(
                f"the engine core process exited during start-up (exit code "
                f"{self.process.exitcode}); see the log above") from None
        if ready[0] == "error":
            self.process.join(_SHUTDOWN_TIMEOUT_S)
            _, kind, text = ready
            if kind == "ValueError":
                raise ValueError(text)
            raise CoreProcessError(f"the engine core failed to start: {text}")
        _, self.info, self.initial_stats = ready
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closing = False
        # Reaping the process from two threads at once loses its exit status (one
        # waitpid gets it, the other ECHILD) and is_alive() then stays True forever.
        self._reap_lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def start(self, on_message: MessageHandler) -> None:
        assert not self._threads, "already started"
        for target, name, fn_args in ((self._send_loop, "pagedlm-core-send", ()),
                                      (self._recv_loop, "pagedlm-core-recv", (on_message,))):
            thread = threading.Thread(target=target, args=fn_args, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _send_loop(self) -> None:
        while True:
            commands = _drain(self._commands, block=True)
            try:
                self._conn.send(commands)
            except (OSError, EOFError, ValueError):  # the core is gone; the receiver reports it
                return
            if any(isinstance(c, ShutdownCommand) for c in commands):
                return

    def _recv_loop(self, on_message: MessageHandler) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            on_message(message)
            if message.dead is not None:
                return
        code = self._wait_exit(10.0)  # the pipe closes first; the exit status follows
        if not self._closing:
            how = f"was killed by signal {-code}" if code is not None and code < 0 else \
                f"exited with code {code}"
            logger.error("the engine core process (pid %s) %s", self.process.pid, how)
            on_message(CoreMessage(dead=f"the engine core process {how}"))

    def submit(self, command: object) -> None:
        self._commands.put(command)

    def _wait_exit(self, timeout: float) -> int | None:
        """The core's exit code once it exits, waiting at most `timeout`; None while it
        runs. Waits on the sentinel without the lock, so is_alive() never blocks."""
        deadline = time.monotonic() + timeout
        multiprocessing.connection.wait([self.process.sentinel], timeout)
        # The sentinel closes as the process's files are closed, a moment before the kernel
        # makes it waitable: poll until the status is there.
        while True:
            with self._reap_lock:
                self.process.join(0)
                if self.process.exitcode is not None or time.monotonic() >= deadline:
                    return self.process.exitcode
            time.sleep(0.005)

    def is_alive(self) -> bool:
        with self._reap_lock:
            return self.process.is_alive()

    def shutdown(self, timeout: float = _SHUTDOWN_TIMEOUT_S) -> None:
        self._closing = True
        if self.is_alive():
            if self._threads:
                self._commands.put(ShutdownCommand())
            else:
                try:
                    self._conn.send([ShutdownCommand()])
                except (OSError, EOFError, ValueError):
                    pass
            self._wait_exit(timeout)
        if self.is_alive():
            logger.warning("the engine core process did not stop in %.0f s: killing it", timeout)
            self.process.kill()
            self._wait_exit(5)
        self._conn.close()


def core_process_main(conn, args: EngineArgs, eos_token_ids: tuple[int, ...],
                      max_num_queued_requests: int | None,
                      log_levels: tuple[int, int] = (logging.WARNING, logging.INFO)) -> None:
    """The core process: load, report ready, loop until shut down or orphaned."""
    from pagedlm.executor.worker_proc import die_with_parent
    from pagedlm.loader.model_loader import resolve_model_source

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the frontend, which stops us
    # The parent's --log-level: a spawned process starts with logging unconfigured.
    root_level, pagedlm_level = log_levels
    logging.basicConfig(level=root_level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedlm").setLevel(pagedlm_level)
    try:
        core = EngineCore(args, resolve_model_source(args.model, args.revision),
                          eos_token_ids)
    except BaseException as e:
        logger.exception("the engine core failed to start")
        conn.send(("error", type(e).__name__, str(e)))
        conn.close()
        return
    conn.send(("ready", core.info, core.get_stats()))

    def recv(block: bool) -> list:
        commands: list = []
        if block or conn.poll(0):
            commands.extend(conn.recv())
        while conn.poll(0):
            commands.extend(conn.recv())
        return commands

    try:
        run_core_loop(core, recv, conn.send, max_num_queued_requests)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.warning("the frontend went away: the engine core stops")
    except BaseException as e:
        logger.exception("the engine core stopped on an error")
        try:
            # The traceback is in this process's log; clients get the error alone.
            conn.send(CoreMessage(dead=f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        core.shutdown()
        os._exit(1)
    core.shutdown()
    conn.close()
