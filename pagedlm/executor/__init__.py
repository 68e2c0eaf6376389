"""Executors: how the engine reaches its workers (in-process, or one process per rank)."""

from pagedlm.executor.base import Executor
from pagedlm.executor.multiproc import MultiprocExecutor, WorkerError
from pagedlm.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "MultiprocExecutor", "UniProcExecutor", "WorkerError"]
