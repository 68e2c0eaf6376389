"""One worker in the engine's own process: a step is a method call, nothing is copied."""

from __future__ import annotations

from pagedlm.config import EngineArgs
from pagedlm.core.sched_output import SchedulerOutput
from pagedlm.executor.base import Executor
from pagedlm.loader.model_loader import ModelSource
from pagedlm.lora.adapter import LoRAAdapter
from pagedlm.worker.model_runner import ModelRunnerOutput
from pagedlm.worker.worker import Worker, WorkerSpec


class UniProcExecutor(Executor):
    def __init__(self, args: EngineArgs, source: ModelSource) -> None:
        self.driver_worker = Worker(args, source)

    def worker_spec(self) -> WorkerSpec:
        return self.driver_worker.worker_spec()

    def determine_num_blocks(self, max_num_batched_tokens: int, max_model_len: int) -> int:
        return self.driver_worker.determine_num_blocks(max_num_batched_tokens, max_model_len)

    def initialize_cache(self, num_blocks: int, max_num_seqs: int, max_model_len: int) -> None:
        self.driver_worker.initialize_cache(num_blocks, max_num_seqs, max_model_len)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_worker.execute_model(sched)

    def check_lora(self, adapter: LoRAAdapter) -> str | None:
        return self.driver_worker.check_lora(adapter)
