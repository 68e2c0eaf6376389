"""Executors: how the engine reaches its workers (in-process, or one process per rank)."""

from pagedlm.executor.base import Executor
from pagedlm.executor.multiproc import MultiprocExecutor, WorkerError
from pagedlm.executor.ray_executor import RayExecutor  # imports Ray (optional) only to start
from pagedlm.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "MultiprocExecutor", "RayExecutor", "UniProcExecutor", "WorkerError", "make_executor"]


def make_executor(args, source) -> Executor:
    """The executor `args` ask for: Ray actors, one process per rank, or this process. Left
    unnamed, one rank runs in this process and several in worker processes; `mp` named with
    one rank still gives that rank a process of its own (the model's faults and memory kept
    apart from the engine's)."""
    backend = args.distributed_executor_backend
    if backend is None:
        backend = "uni" if args.tensor_parallel_size == 1 else "mp"
    if backend == "ray":
        return RayExecutor(args)
    if backend == "uni":
        return UniProcExecutor(args, source)
    return MultiprocExecutor(args)
