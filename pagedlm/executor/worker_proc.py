"""The process of one tensor-parallel rank.

Started by `MultiprocExecutor` (`main()`) as a fresh interpreter (not multiprocessing's
spawn, which would re-import the user's main script), it connects back to the engine over
a loopback socket, proves it is the engine's child with the token it was given, receives its rank
and the engine arguments, joins the torch.distributed group, builds its Worker and then
runs the methods the engine sends until told to stop or the engine goes away.

Messages, pickled: engine -> rank `(method, args)`; rank -> engine `("ok", result)`,
`("invalid", (message, traceback))` for a ValueError at start-up (a bad argument, a
dimension that does not divide), or `("error", traceback)`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import socket
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from pagedlm.executor.multiproc import ENV_ADDRESS, ENV_TOKEN
from pagedlm.layers.parallel_state import ShmAllReduce, set_shm_all_reduce, set_tp_group
from pagedlm.loader.model_loader import resolve_model_source
from pagedlm.structured import RemoteBitmask
from pagedlm.worker.worker import Worker, resolve_device

COLLECTIVE_TIMEOUT = timedelta(seconds=120)


def connect(address: str, token: str) -> Connection:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    conn = Connection(sock.detach())
    conn.send_bytes(bytes.fromhex(token))
    return conn


def die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the engine gone, the rank goes too
    except OSError:
        pass  # not Linux: the closed socket still ends the loop


def init_worker(args, rank: int, world_size: int, master_addr: str, port: int,
                cores: list[int] | None, local_rank: int | None = None,
                shm_path: str | None = None):
    """Join the tensor-parallel group as `rank` and build this rank's Worker (the model's
    shard, its KV cache geometry). Shared by worker processes and Ray actors. With
    `shm_path` (ranks on one machine, CPU), float32 all-reduces go through that shared
    segment instead of gloo."""
    if cores is not None:
        os.sched_setaffinity(0, cores)
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank if local_rank is None else local_rank)
    if args.num_threads is None:
        torch.set_num_threads(len(cores) if cores is not None else 1)
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(port))
    if master_addr == "127.0.0.1":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    set_tp_group(rank, world_size)
    if shm_path is not None:
        try:
            set_shm_all_reduce(ShmAllReduce(shm_path, rank, world_size))
        except RuntimeError as e:  # no compiler: gloo does it, slower
            logging.getLogger(__name__).warning("all-reduce through gloo: %s", e)
    return Worker(args, resolve_model_source(args.model, args.revision), rank=rank,
                  device_index=local_rank)


def serve(conn: Connection) -> None:
    rank, world_size, port, cores, shm_path, args = pickle.loads(conn.recv_bytes())
    try:
        worker = init_worker(args, rank, world_size, "127.0.0.1", port, cores,
                             shm_path=shm_path)
        conn.send(("ok", None))
    except ValueError as e:
        conn.send(("invalid", (str(e), traceback.format_exc())))
        return
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    # Rank 0 reads a step's grammar bitmask, sent after the step, when it samples (the
    # other ranks do not sample and are sent none).
    if rank == 0:
        RemoteBitmask.receive = lambda: pickle.loads(conn.recv_bytes())
    with torch.inference_mode():  # once for the process, not once per step
        _serve_loop(conn, worker, rank)
    shutdown_group()


def _serve_loop(conn: Connection, worker, rank: int) -> None:
    while True:
        try:
            method, method_args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the engine is gone
        if method == "shutdown":
            break
        try:
            result = getattr(worker, method)(*method_args)
            RemoteBitmask.drain_unread()
            # Every rank computes the same step result; only rank 0's crosses back.
            conn.send(("ok", result if rank == 0 or method != "execute_model" else None))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            break


def shutdown_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    die_with_parent()
    # Ctrl-C reaches the whole process group: the engine decides, and stops the ranks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = connect(os.environ[ENV_ADDRESS], os.environ[ENV_TOKEN])
    try:
        serve(conn)
    finally:
        conn.close()
    sys.exit(0)

