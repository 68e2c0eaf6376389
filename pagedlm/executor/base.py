"""The engine's side of the engine/worker boundary.

An executor owns the workers and speaks to them only in data: a `SchedulerOutput` in, a
`ModelRunnerOutput` out, each step. The engine never touches a model, a weight or a KV
cache tensor, so the same engine runs one in-process worker or several ranks elsewhere.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pagedlm.core.sched_output import SchedulerOutput
from pagedlm.lora.adapter import LoRAAdapter
from pagedlm.worker.model_runner import ModelRunnerOutput
from pagedlm.worker.worker import WorkerSpec


class Executor(ABC):
    @abstractmethod
    def worker_spec(self) -> WorkerSpec:
        """The cache geometry every worker shares."""

    @abstractmethod
    def determine_num_blocks(self, max_num_batched_tokens: int, max_model_len: int) -> int:
        """KV blocks every worker can hold (the smallest over workers)."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int, max_num_seqs: int, max_model_len: int) -> None:
        """Allocate `num_blocks` blocks on every worker and get their step paths ready."""

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; the sampled result (the same on every rank)."""

    @abstractmethod
    def check_lora(self, adapter: LoRAAdapter) -> str | None:
        """Why `adapter` does not fit the model (the first rank's complaint), or None."""

    def shutdown(self) -> None:  # noqa: B027 - nothing to stop in-process
        """Stop the workers; the executor cannot be used afterwards."""


class RankedExecutor(Executor):
    """Workers on several ranks, reached through `_call`: every Executor method is the
    same Worker method run on every rank."""

    @abstractmethod
    def _call(self, method: str, *args) -> list:
        """Run the Worker's `method` on every rank; returns each rank's result."""

    def _step_message(self, sched: SchedulerOutput) -> object:
        """What `execute_model` sends every rank (a backend may serialise it once)."""
        return sched

    def worker_spec(self) -> WorkerSpec:
        return self._call("worker_spec")[0]

    def determine_num_blocks(self, max_num_batched_tokens: int, max_model_len: int) -> int:
        return min(self._call("determine_num_blocks", max_num_batched_tokens, max_model_len))

    def initialize_cache(self, num_blocks: int, max_num_seqs: int, max_model_len: int) -> None:
        self._call("initialize_cache", num_blocks, max_num_seqs, max_model_len)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self._call("execute_model", self._step_message(sched))[0]

    def check_lora(self, adapter: LoRAAdapter) -> str | None:
        return next((e for e in self._call("check_lora", adapter) if e is not None), None)
