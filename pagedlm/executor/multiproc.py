"""Tensor parallelism on one machine: one worker process per rank, torch.distributed between
them (gloo on CPU, NCCL on CUDA), rendezvous on 127.0.0.1.

    engine process                     rank 0 process          rank 1 process
    --------------                     --------------          --------------
    schedule() -> SchedulerOutput
    pickle once, send to every rank -> update batch, forward   update batch, forward
                                       (all-reduce per layer <-> all-reduce per layer)
                                       LM head, sample          LM head (its shard)
    <- ModelRunnerOutput of rank 0     reply                    reply None

Every rank applies the same SchedulerOutput to its own persistent batch, so nothing but
the step's small message crosses the sockets. A structured-output step's token bitmask,
still being filled by llguidance when the step is sent, follows to rank 0 alone in a
second message (structured.RemoteBitmask): the fill overlaps the forward here too. Only rank 0 samples: the others learn the
sampled tokens from the next step's message, as every worker does (a worker never appends
its own samples), so their batches stay in step without a broadcast.

Ranks are fresh interpreters (`python -c "...worker_proc import main; main()"`: not `-m`,
which would run a second copy of a module the package already imports), so a user's
script needs no `if __name__ == "__main__":` guard; each connects back over a loopback
socket with a token only it was given.

Faults: a rank that dies (killed, out of memory) closes its socket, which wakes the
engine's wait at once; an exception in a rank is sent back with its traceback. Either
way the executor kills every rank (a peer may be blocked in a collective) and the
engine's step raises `WorkerError`. Ranks die with the engine process (PR_SET_PDEATHSIG,
and a closed socket ends their loop).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

from pagedlm.config import EngineArgs
from pagedlm.csrc import PREBUILT_ENV, load_all_extensions
from pagedlm.executor.base import RankedExecutor
from pagedlm.layers.parallel_state import shm_segment_bytes
from pagedlm.structured import RemoteBitmask

if TYPE_CHECKING:
    from pagedlm.core.sched_output import SchedulerOutput
    from pagedlm.worker.model_runner import ModelRunnerOutput

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 600.0  # loading a large model's shard can take minutes
ENV_ADDRESS = "PAGEDLM_WORKER_ADDRESS"  # host:port of the engine's listening socket
ENV_TOKEN = "PAGEDLM_WORKER_TOKEN"  # hex; the first thing a worker sends
_WORKER_MAIN = "from pagedlm.executor.worker_proc import main; main()"


class WorkerError(RuntimeError):
    """A worker process failed or died; the executor is unusable afterwards."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cores_for(rank: int, world_size: int) -> list[int] | None:
    """This rank's share of the cores the engine may use, or None if there are fewer
    cores than ranks (then nothing is pinned)."""
    cores = sorted(os.sched_getaffinity(0))
    per_rank = len(cores) // world_size
    if per_rank < 1:
        return None
    return cores[rank * per_rank : (rank + 1) * per_rank]


def _shm_segment(world_size: int) -> str | None:
    """A zeroed file in /dev/shm for the ranks' shared-memory all-reduce, or None."""
    if not os.path.isdir("/dev/shm"):
        return None
    fd, path = tempfile.mkstemp(prefix="pagedlm-tp-", dir="/dev/shm")
    os.ftruncate(fd, shm_segment_bytes(world_size))
    os.close(fd)
    return path


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _stop(procs: list[subprocess.Popen], conns: list[Connection]) -> None:
    """Ask every rank to stop, then kill those still running after a few seconds."""
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(("shutdown", ())))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 5
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    _kill(procs)
    for conn in conns:
        conn.close()


def _accept(listener: socket.socket, tokens: list[bytes], procs: list[subprocess.Popen],
            timeout: float) -> tuple[int, Connection]:
    """The next rank that connects, known by its token (a rank that exits first, or silence
    past `timeout`, is an error)."""
    deadline = time.monotonic() + timeout
    listener.settimeout(0.5)
    while True:
        for rank, proc in enumerate(procs):
            if proc.poll() is not None:
                raise WorkerError(f"rank {rank} exited with code {proc.returncode} before "
                                  "connecting to the engine")
        if time.monotonic() > deadline:
            raise WorkerError(f"the worker processes did not connect within {timeout:.0f} s")
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            continue
        sock.setblocking(True)
        conn = Connection(sock.detach())
        if conn.poll(5):
            token = conn.recv_bytes()
            for rank, expected in enumerate(tokens):
                if secrets.compare_digest(token, expected):
                    return rank, conn
        conn.close()  # not one of ours


class MultiprocExecutor(RankedExecutor):
    def __init__(self, args: EngineArgs) -> None:
        self.world_size = args.tensor_parallel_size
        kernels: dict[str, str] = {}
        if args.device != "cuda":
            kernels = load_all_extensions()  # built once here, not by every rank at once
        # Each rank is told its own token: whoever connects with it is that rank.
        tokens = [secrets.token_bytes(16) for _ in range(self.world_size)]
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(self.world_size)
        host, port = listener.getsockname()
        self.procs = [
            subprocess.Popen([sys.executable, "-c", _WORKER_MAIN],
                             env=dict(os.environ, **{ENV_ADDRESS: f"{host}:{port}",
                                                     ENV_TOKEN: token.hex(),
                                                     PREBUILT_ENV: json.dumps(kernels)}),
                             stdin=subprocess.DEVNULL)
            for token in tokens
        ]
        self.conns: list[Connection] = []
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        self._failed: str | None = None
        by_rank: dict[int, Connection] = {}
        try:
            while len(by_rank) < self.world_size:
                rank, conn = _accept(listener, tokens, self.procs, _STARTUP_TIMEOUT_S)
                by_rank[rank] = conn
        except WorkerError as e:
            self.conns.extend(by_rank.values())
            self._fail(str(e))
        finally:
            listener.close()
        self.conns.extend(by_rank[r] for r in range(self.world_size))
        dist_port = _free_port()
        shm_path = _shm_segment(self.world_size) if args.device != "cuda" else None
        try:
            for rank, conn in enumerate(self.conns):
                conn.send_bytes(pickle.dumps((rank, self.world_size, dist_port,
                                              _cores_for(rank, self.world_size), shm_path, args)))
            self._gather(timeout=_STARTUP_TIMEOUT_S, what="start-up")
        finally:
            if shm_path is not None:
                os.unlink(shm_path)  # every rank has it mapped; nothing is left behind
        logger.info("tensor parallel: %d ranks, one worker process each (pids %s)",
                    self.world_size, [p.pid for p in self.procs])

    # ----- talking to the ranks ----------------------------------------------------------

    def _call(self, method: str, *args) -> list:
        """Run `method` on every rank; returns each rank's result."""
        self._send(method, *args)
        return self._gather(timeout=None, what=method)

    def _send(self, method: str, *args) -> None:
        """Start `method` on every rank (pickled once)."""
        if self._failed is not None:
            raise WorkerError(f"the tensor-parallel workers stopped earlier: {self._failed}")
        data = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except (OSError, ValueError):
            pass  # a dead rank: _gather reports which

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """The step goes to every rank at once; a grammar bitmask still being filled
        follows to rank 0 alone, so the fill overlaps the ranks' forward."""
        pending = sched.grammar_bitmask
        if pending is None:
            return super().execute_model(sched)
        sched.grammar_bitmask = RemoteBitmask(pending.rows)
        try:
            self._send("execute_model", sched)
        finally:
            sched.grammar_bitmask = pending
        try:
            self.conns[0].send_bytes(pickle.dumps(pending.result(),
                                                  protocol=pickle.HIGHEST_PROTOCOL))
        except (OSError, ValueError):
            pass  # a dead rank: _gather reports which
        return self._gather(timeout=None, what="execute_model")[0]

    def _gather(self, timeout: float | None, what: str) -> list:
        """Each rank's reply. A rank that dies closes its socket, which wakes the wait at
        once: the error names it and its exit code."""
        results: list = [None] * self.world_size
        pending = set(range(self.world_size))
        while pending:
            conns = {self.conns[r]: r for r in pending}
            ready = wait(list(conns), timeout)
            if not ready:
                self._fail(f"no answer from ranks {sorted(pending)} within {timeout:.0f} s ({what})")
            for conn in ready:
                rank = conns[conn]
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    proc = self.procs[rank]
                    try:
                        code = proc.wait(timeout=2)
                    except subprocess.TimeoutExpired:
                        code = None
                    self._fail(f"rank {rank} (pid {proc.pid}) died during {what} "
                               f"(exit code {code})")
                if status == "invalid":
                    message, trace = value
                    logger.debug("rank %d refused its arguments:\n%s", rank, trace)
                    self._fail(message, ValueError)
                if status == "error":
                    self._fail(f"rank {rank} failed in {what}:\n{value}")
                results[rank] = value
                pending.discard(rank)
        return results

    def _fail(self, message: str, error: type[Exception] = WorkerError):
        self._failed = message
        if error is WorkerError:
            logger.error("tensor-parallel worker failure: %s", message)
        _kill(self.procs)  # a peer may be blocked in a collective: no graceful stop
        self.shutdown()
        raise error(message)

    # ----- Executor ----------------------------------------------------------------------

    def shutdown(self) -> None:
        self._finalizer()
