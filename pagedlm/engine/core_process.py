"""The engine core in a process of its own, so that HTTP, tokenisation and
detokenisation never hold the core's GIL: ProcessCoreClient (this process's side) and
core_process_main (the core process's). The core loop and its commands and messages are
engine/core_client.py's.

    frontend (event loop)                           core process
    ---------------------                           ------------------------------------------
    submit(Add | Abort | Finish)  -> SimpleQueue --[sender thread, pipe]--> run_core_loop
    on_message(CoreMessage)       <--[receiver thread, pipe]-- one CoreMessage per step

Everything crossing the pipe is pickled; one message carries a whole step. The core
process dies with its parent (the pipe's end or PR_SET_PDEATHSIG), and the parent sees the
core's death at once (the pipe closes), whatever killed it.
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

from pagedlm.config import EngineArgs
from pagedlm.engine.core import EngineCore
from pagedlm.engine.core_client import (
    CoreMessage,
    MessageHandler,
    ShutdownCommand,
    drain,
    run_core_loop,
)
from pagedlm.executor.worker_proc import die_with_parent
from pagedlm.loader.model_loader import resolve_model_source

logger = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 20.0


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
            commands = drain(self._commands, block=True)
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
