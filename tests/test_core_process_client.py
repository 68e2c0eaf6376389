"""ProcessCoreClient reading the core's pipe on an event loop, against a stand-in core
process that speaks the pipe's protocol and sends large messages back to back: the loop
gets them in order, and a shutdown called on the loop (as the server's lifespan calls it,
so the loop reads nothing meanwhile) still lets the core read its ShutdownCommand and exit
instead of blocking on a full pipe until it is killed."""

from __future__ import annotations

import asyncio
import multiprocessing
import time

from pagedlm.engine.core_client import CoreMessage, ShutdownCommand
from pagedlm.engine.core_launch import CoreLaunch
from pagedlm.engine.core_process import ProcessCoreClient

PAYLOAD = 1 << 20  # far more than a pipe holds


def _stand_in_core(conn) -> None:
    conn.recv()  # the eos token ids
    conn.send(("ready", "info", "stats"))
    sent = 0
    while True:
        if conn.poll():
            if any(isinstance(c, ShutdownCommand) for c in conn.recv()):
                return
        conn.send(CoreMessage(dashboard=f"{sent:08d}" + "x" * PAYLOAD))
        sent += 1


def test_loop_reader_gets_every_message_and_shutdown_never_blocks_the_core():
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe()
    process = ctx.Process(target=_stand_in_core, args=(there,), daemon=True)
    process.start()
    there.close()
    client = ProcessCoreClient(None, (0,), launch=CoreLaunch(process, here))
    assert client.info == "info"

    async def main() -> tuple[list[int], float]:
        loop = asyncio.get_running_loop()
        seen: list[int] = []
        enough = asyncio.Event()

        def on_message(message: CoreMessage) -> None:
            seen.append(int(message.dashboard[:8]))
            if len(seen) == 5:
                enough.set()

        client.start(on_message, loop)
        await asyncio.wait_for(enough.wait(), 30)
        start = time.monotonic()
        client.shutdown(timeout=10)  # on the loop, which reads nothing until it returns
        return seen, time.monotonic() - start

    seen, took = asyncio.run(main())
    assert seen == list(range(len(seen)))
    assert process.exitcode == 0, "the stand-in core was killed: it never saw the shutdown"
    assert took < 10
