"""The engine core process's side: wait for the frontend's EOS ids, build the core, report
ready, then run the core loop (engine/core_client.py's) on the pipe until shut down or
orphaned. Started by engine/core_launch.py; the frontend's side is engine/core_process.py.
"""

from __future__ import annotations

import logging
import os
import signal

from pagedlm.config import EngineArgs
from pagedlm.csrc import prepare_cpu_kernels
from pagedlm.engine.core import EngineCore
from pagedlm.engine.core_client import CoreMessage, run_core_loop
from pagedlm.executor.worker_proc import die_with_parent
from pagedlm.loader.model_loader import resolve_model_source
from pagedlm.worker.worker import resolve_device

logger = logging.getLogger(__name__)


def core_process_main(conn, args: EngineArgs, max_num_queued_requests: int | None,
                      log_levels: tuple[int, int] = (logging.WARNING, logging.INFO)) -> None:
    """The core process: wait for the EOS ids, load, report ready, loop until shut down or
    orphaned."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the frontend, which stops us
    # The parent's --log-level: a spawned process starts with logging unconfigured.
    root_level, pagedlm_level = log_levels
    logging.basicConfig(level=root_level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedlm").setLevel(pagedlm_level)
    try:
        on_cpu = resolve_device(args.device).type == "cpu"
    except ValueError:
        on_cpu = False  # a bad --device: building the core below reports it
    if on_cpu:
        # A first start's kernel build, while the frontend loads the tokenizer (the worker
        # would do it below otherwise).
        prepare_cpu_kernels()
    try:
        eos_token_ids = conn.recv()  # sent once the frontend's tokenizer is loaded
    except (EOFError, OSError):
        return  # the frontend gave up before taking us over (a bad argument, Ctrl-C)
    try:
        source = resolve_model_source(args.model, args.revision)
        logger.info("engine core: loading %s", source.path)
        core = EngineCore(args, source, eos_token_ids)
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
