"""Starting the engine core's process, from a module light enough to import first.

`pagedlm serve` starts the core before it imports the server (FastAPI, the engine's
frontend, the tokenizer): the core's imports and model load then run beside the
frontend's instead of after them. The core waits for one message before it loads: the
EOS token ids, which the frontend knows once its tokenizer is loaded (ProcessCoreClient
sends them and takes the launch over).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

from pagedlm.config import EngineArgs
from pagedlm.loader.model_paths import local_model_path


@dataclass
class CoreLaunch:
    """A core process started and not yet ready: its process and this side's pipe end."""

    process: BaseProcess
    conn: multiprocessing.connection.Connection

    def abandon(self, timeout: float = 5.0) -> None:
        """Let the process go (the frontend failed before taking it over, or has shut it
        down): its pipe closes, and it exits when it next reads from it, which it does as
        soon as its imports (or a first start's kernel build) are done. Waits up to
        `timeout` for that, so that a build about to finish is kept; it dies with this
        process anyway (a build killed mid-way leaves no lock to wait on: csrc's
        _build_lock). Idempotent."""
        self.conn.close()
        self.process.join(timeout)


# How long the core's OpenMP threads spin after a parallel region before they sleep
# (libgomp's GOMP_SPINCOUNT; its default is 300,000 spins). The core shares the machine's
# cores with the frontend and the clients: a thread spinning through the Python between
# two kernels holds a core that a frontend's burst then takes from a thread inside the
# next kernel, and that kernel's other threads wait for it at the barrier. Served
# ShareGPT-64 at rate inf on the 2-core EPYC VM, default and 10,000 taking turns (8
# pairs): median 381 -> 415 output tok/s, core CPU time about 65 -> 58 s; 0 (no spin) was
# worse, 271-293 tok/s. A GOMP_SPINCOUNT of the user's own is kept.
CORE_GOMP_SPINCOUNT = "10000"


def launch_core(args: EngineArgs, max_num_queued_requests: int | None = None) -> CoreLaunch:
    """Start the engine core's process for `args`, then fetch the model here if it must be
    (the embedded default on first use, a repo id not in the hub's cache). The process
    imports and builds the CPU kernels meanwhile (a first start's longest step); it
    resolves the model only once the frontend's EOS ids arrive, after the frontend has
    resolved it too (its tokenizer), so the two never race to download it. Returns once
    the process is started and the model is here; a failed fetch abandons the process."""
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe(duplex=True)
    log_levels = (logging.getLogger().level, logging.getLogger("pagedlm").getEffectiveLevel())
    process = ctx.Process(target=_core_entry, name="pagedlm-engine-core",
                          args=(child_conn, args, max_num_queued_requests, log_levels))
    own = "GOMP_SPINCOUNT" not in os.environ
    if own:
        os.environ["GOMP_SPINCOUNT"] = CORE_GOMP_SPINCOUNT  # the spawned process's environment
    try:
        process.start()
    finally:
        if own:
            os.environ.pop("GOMP_SPINCOUNT", None)
    child_conn.close()
    launch = CoreLaunch(process, conn)
    try:
        local_model_path(args.model, args.revision)
    except BaseException:
        launch.abandon()
        raise
    return launch


def _core_entry(conn, args: EngineArgs, max_num_queued_requests: int | None,
                log_levels: tuple[int, int]) -> None:
    # The core's imports (torch, the models, the loader) happen here, in the child: the
    # parent imports this module without them.
    from pagedlm.engine.core_main import core_process_main

    core_process_main(conn, args, max_num_queued_requests, log_levels)
