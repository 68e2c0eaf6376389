"""engine/cpu_share.py: when the core leaves a core to the frontend, and the flag the
frontend's event loop keeps (up while it runs callbacks, down while it waits). The
kernels' side is tests/test_lite_tensor.py's; the server's, tests/server/test_core_process.py's."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from pagedlm.engine import cpu_share
from pagedlm.engine.cpu_share import FLAG_ENV, SWITCH_ENV, CpuShare


@pytest.mark.parametrize("setting,threads,cores,expected", [
    (None, 2, 2, True),    # the threads fill the cores
    (None, 4, 2, True),
    (None, 2, 4, False),   # a core is free for the frontend
    (None, 1, 1, False),   # one thread: nothing to leave
    ("0", 2, 2, False),
    ("1", 2, 4, True),
    ("1", 1, 4, False),
])
def test_the_core_shares_when_its_threads_fill_the_cores(monkeypatch, setting, threads, cores,
                                                          expected):
    if setting is None:
        monkeypatch.delenv(SWITCH_ENV, raising=False)
    else:
        monkeypatch.setenv(SWITCH_ENV, setting)
    assert cpu_share.core_uses_share(threads, cores) is expected


def test_a_core_that_does_not_share_forgets_the_flag(monkeypatch):
    monkeypatch.delenv(SWITCH_ENV, raising=False)
    monkeypatch.setenv(FLAG_ENV, "/psm_test")
    assert cpu_share.keep_flag_if_used(len(os.sched_getaffinity(0)) + 1) is True
    assert os.environ[FLAG_ENV] == "/psm_test"
    assert cpu_share.keep_flag_if_used(1) is False
    assert FLAG_ENV not in os.environ
    assert cpu_share.keep_flag_if_used(64) is False  # no flag offered


def test_the_flag_lives_in_shared_memory_until_closed():
    share = CpuShare()
    path = "/dev/shm" + share.env[FLAG_ENV]
    assert os.path.exists(path) and not share.busy
    with open(path, "rb") as f:
        assert f.read() == b"\0"
    share.set_busy(True)
    with open(path, "rb") as f:  # what the core's mapping reads
        assert f.read() == b"\1"
    assert share.busy
    share.close()
    share.close()  # idempotent
    assert not os.path.exists(path) and not share.busy
    share.set_busy(True)  # after close: ignored, no error


def test_the_event_loop_raises_the_flag_only_while_it_runs():
    share = CpuShare()
    seen_waiting: list[bool] = []
    seen_running: list[bool] = []
    stop = threading.Event()

    def watch() -> None:  # what the core sees, sampled from another thread
        while not stop.is_set():
            seen_waiting.append(share.busy)
            time.sleep(0.002)

    async def main() -> None:
        seen_running.append(share.busy)  # inside a callback
        watcher = threading.Thread(target=watch)
        watcher.start()
        await asyncio.sleep(0.3)  # the loop waits in select: the flag is down
        stop.set()
        watcher.join()
        seen_running.append(share.busy)
        start = time.perf_counter()
        while time.perf_counter() - start < 0.05:  # a callback computing: up
            pass
        seen_running.append(share.busy)

    try:
        with asyncio.Runner(loop_factory=share.loop_factory()) as runner:
            runner.run(main())
        assert not share.busy  # the loop's end lowers it
    finally:
        share.close()
    assert seen_running == [True, True, True]
    assert len(seen_waiting) > 20
    # Down while the loop slept (the watcher's first looks may race the loop into select).
    assert sum(seen_waiting) <= 2, seen_waiting
