"""Executors: how the engine reaches its workers (in-process, or one process per rank)."""

from pagedlm.executor.base import Executor
from pagedlm.executor.multiproc import MultiprocExecutor, WorkerError
from pagedlm.executor.ray_executor import RayExecutor  # imports Ray (optional) only to start
from pagedlm.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "MultiprocExecutor", "RayExecutor", "UniProcExecutor", "WorkerError", "make_executor"]


def make_executor(args, source) -> Executor:
    """The executor `args` ask for: Ray actors, one process per rank, or this process."""
    if args.distributed_executor_backend == "ray":
        return RayExecutor(args)
    if args.tensor_parallel_size == 1:
        return UniProcExecutor(args, source)
    return MultiprocExecutor(args)
