"""Sharing the cores between the engine core's compute threads and the server's frontend,
when those threads fill every core (the 2-core laptop or VM).

A frontend that wakes up takes a core from one of the compute threads. That thread holds
its part of the kernel it was in, and the other threads finish theirs and then wait for it
at the kernel's end: a CPU-second of the frontend costs the core up to a second of every
thread. (Offline ShareGPT decoding on 2 cores beside a process that burns 10% of one core
in 5 ms bursts ran 1.12-1.17x slower, against the 1.05x of the CPU it took:
benchmarks/cpu/cpu_share_burst.py.)

So the frontend says when it runs. It raises a flag in shared memory while its event loop
runs callbacks and lowers it while the loop waits in select. While the flag is up, the
core's kernels start one thread fewer, and the last thread of a kernel already running
takes no further chunk (csrc/lite_tensor.h, parallel_for): the frontend's core is handed
over within a chunk instead of being fought for. With one thread or more cores than compute
threads, the core ignores the flag (there is a free core for the frontend).

    frontend (launch_core)   CpuShare(): the flag, named to the core's process in its
                             environment (PAGEDLM_CPU_SHARE_FLAG, read by the kernels)
    core process (core_main) core_uses_share(): keeps the name only if its threads fill
                             the cores; says so in CoreInfo.cpu_share
    frontend (run_server)    the event loop's selector raises and lowers the flag

PAGEDLM_CPU_SHARE=0 turns it off, =1 on whatever the thread count.
"""

from __future__ import annotations

import asyncio
import os
import selectors
from collections.abc import Callable
from multiprocessing import shared_memory

FLAG_ENV = "PAGEDLM_CPU_SHARE_FLAG"  # the flag's shared-memory name (csrc/lite_tensor.h)
SWITCH_ENV = "PAGEDLM_CPU_SHARE"  # "0": off; "1": on whatever the thread count


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "") != "0"


def core_uses_share(num_threads: int, usable_cores: int | None = None) -> bool:
    """Whether a core with `num_threads` compute threads should leave a core to the frontend
    while its flag is up: when its threads take every core the process may use."""
    setting = os.environ.get(SWITCH_ENV, "")
    if setting in ("0", "1"):
        return setting == "1" and num_threads > 1
    if usable_cores is None:
        usable_cores = len(os.sched_getaffinity(0))
    return num_threads > 1 and num_threads >= usable_cores


def keep_flag_if_used(num_threads: int) -> bool:
    """In the core's process, before its first kernel runs: forget the flag's name unless
    this core should use it (the kernels read the environment once, at their first call).
    Returns whether it is used."""
    if FLAG_ENV not in os.environ:
        return False
    if core_uses_share(num_threads):
        return True
    del os.environ[FLAG_ENV]
    return False


class CpuShare:
    """The frontend's flag: one byte of shared memory, up while the frontend is busy."""

    def __init__(self) -> None:
        self._shm = shared_memory.SharedMemory(create=True, size=1)
        self._buf: memoryview | None = self._shm.buf
        self._buf[0] = 0

    @property
    def env(self) -> dict[str, str]:
        """The variable that names the flag to the core's process (shm_open's name)."""
        return {FLAG_ENV: "/" + self._shm.name}

    @property
    def busy(self) -> bool:
        return self._buf is not None and self._buf[0] != 0

    def set_busy(self, busy: bool) -> None:
        if self._buf is not None:
            self._buf[0] = 1 if busy else 0

    def selector(self) -> selectors.BaseSelector:
        """A selector for the frontend's event loop that keeps the flag: down while it
        waits for events, up while the loop runs what they started."""
        return _FlaggingSelector(self)

    def loop_factory(self) -> Callable[[], asyncio.AbstractEventLoop]:
        return lambda: asyncio.SelectorEventLoop(self.selector())

    def close(self) -> None:
        """Lower the flag and remove it (a core that mapped it keeps its mapping, which
        now reads 0). Idempotent."""
        if self._buf is None:
            return
        self._buf[0] = 0
        self._buf.release()
        self._buf = None
        self._shm.close()
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass


class _FlaggingSelector(selectors.DefaultSelector):
    def __init__(self, share: CpuShare) -> None:
        super().__init__()
        self._share = share
        share.set_busy(True)  # the loop runs from here on, until it first waits

    def close(self) -> None:  # the loop's end
        self._share.set_busy(False)
        super().close()

    def select(self, timeout: float | None = None) -> list:
        if timeout is not None and timeout <= 0:  # a poll between callbacks: still busy
            return super().select(timeout)
        self._share.set_busy(False)
        try:
            return super().select(timeout)
        finally:
            self._share.set_busy(True)
            # If this thread took a compute thread's core, let that thread finish its
            # chunk now (it takes no further one): then the core is this one's alone.
            os.sched_yield()
