"""The engine core in a process of its own, so that HTTP, tokenisation and
detokenisation never hold the core's GIL: ProcessCoreClient, the frontend's side. The
process is started by engine/core_launch.py and runs engine/core_main.py; the core loop
and its commands and messages are engine/core_client.py's.

    frontend (event loop)                           core process
    ---------------------                           ------------------------------------------
    submit(Add | Abort | Finish)  -> SimpleQueue --[sender thread, pipe]--> run_core_loop
    on_message(CoreMessage)       <--[the loop's reader on the pipe]-- one CoreMessage per step

Everything crossing the pipe is pickled; one message carries a whole step. The core
process dies with its parent (the pipe's end or PR_SET_PDEATHSIG), and the parent sees the
core's death at once (the pipe closes), whatever killed it.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import queue
import threading
import time
from collections.abc import Callable

from pagedlm.config import EngineArgs
from pagedlm.engine.core_client import (
    CoreMessage,
    MessageHandler,
    ShutdownCommand,
    drain,
)
from pagedlm.engine.core_launch import CoreLaunch, launch_core

logger = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 20.0


class CoreProcessError(RuntimeError):
    """The core process could not start."""


class ProcessCoreClient:
    """The core in a process of its own, started here and loaded before this returns.
    Raises ValueError for bad engine arguments (as the in-process engine would)."""

    def __init__(self, args: EngineArgs, eos_token_ids: tuple[int, ...],
                 max_num_queued_requests: int | None = None,
                 launch: CoreLaunch | None = None) -> None:
        """`launch`: a core process already started for `args` (engine/core_launch.py),
        taken over here; by default one is started now."""
        if launch is None:
            launch = launch_core(args, max_num_queued_requests)
        self.process, self._conn = launch.process, launch.conn
        try:
            self._conn.send(tuple(eos_token_ids))  # what the core waits for to load
        except OSError:
            pass  # it died already: the recv below says so
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
        self._reader_loop: asyncio.AbstractEventLoop | None = None  # start(loop=...) sets it
        self._closing = False
        # Reaping the process from two threads at once loses its exit status (one
        # waitpid gets it, the other ECHILD) and is_alive() then stays True forever.
        self._reap_lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def start(self, on_message: MessageHandler,
              loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Deliver the core's messages to `on_message`: on `loop`, which reads them as the
        pipe becomes readable, or without a loop on a receiver thread of its own.

        With a loop there is no thread to hand each step's message over, so no GIL to pass
        between two threads and no wake-up of the loop through its self-pipe: in a served
        ShareGPT-64 run on the Zen 5 VM, the receiver thread held the GIL in 6.5% of the
        frontend's samples and the self-pipe's reads in 2% (`benchmarks/cpu/
        frontend_profile.py --gil`).
        """
        assert not self._threads, "already started"
        threads: list[tuple[Callable[..., None], str, tuple]] = [
            (self._send_loop, "pagedlm-core-send", ())]
        if loop is None:
            threads.append((self._recv_loop, "pagedlm-core-recv", (on_message,)))
        else:
            self._reader_loop = loop
            loop.add_reader(self._conn.fileno(), self._read_ready, on_message)
        for target, name, fn_args in threads:
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
        self._report_exit(on_message)

    def _read_ready(self, on_message: MessageHandler) -> None:
        """On the loop, whenever the pipe is readable: every message waiting there. (A
        message the core is still writing is read to its end: the core writes it whole.)"""
        conn = self._conn
        try:
            while True:
                message = conn.recv()
                on_message(message)
                if message.dead is not None:
                    self._stop_reading()
                    return
                if not conn.poll():
                    return
        except (EOFError, OSError):
            pass
        loop = self._reader_loop
        self._stop_reading()

        def deliver(message: CoreMessage) -> None:
            try:
                loop.call_soon_threadsafe(on_message, message)
            except RuntimeError:  # the loop closed during shutdown: nobody is listening
                pass

        # The exit status comes a moment after the pipe closes: wait for it off the loop.
        watcher = threading.Thread(target=self._report_exit, args=(deliver,),
                                   name="pagedlm-core-exit", daemon=True)
        watcher.start()
        self._threads.append(watcher)

    def _stop_reading(self) -> None:
        loop, self._reader_loop = self._reader_loop, None
        if loop is None or loop.is_closed():
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop or not loop.is_running():
            loop.remove_reader(self._conn.fileno())
        else:
            loop.call_soon_threadsafe(loop.remove_reader, self._conn.fileno())

    def _discard_messages(self) -> None:
        """Read and drop what the core still sends until it closes the pipe, so that a core
        finishing a step during shutdown never blocks on a full pipe nobody reads."""
        try:
            while True:
                self._conn.recv()
        except (EOFError, OSError):
            pass

    def _report_exit(self, on_message: MessageHandler) -> None:
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
        if self._reader_loop is not None:  # the loop may not read the pipe while we wait
            self._stop_reading()
            threading.Thread(target=self._discard_messages, name="pagedlm-core-discard",
                             daemon=True).start()
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
