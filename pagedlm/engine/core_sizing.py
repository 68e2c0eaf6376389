"""Sizing an engine core at start-up, in this order: the tokens one step may batch, the
KV cache's blocks (the executor profiles a step at that size), the context served
(max_model_len, as far as the cache holds it) and the scheduler's budgets. A limit the
user set that cannot be met is a ValueError naming it."""

from __future__ import annotations

from pagedlm.config import EngineArgs, SchedulerConfig
from pagedlm.core.kv_cache_manager import KVCacheManager
from pagedlm.executor import Executor
from pagedlm.worker.worker import WorkerSpec

# Prompt tokens per step while requests decode, by default (see Scheduler._prefill_budget;
# the CPU figure is measured in benchmarks/results/engine_core/).
DEFAULT_CPU_PREFILL_WITH_DECODES = 64
DEFAULT_GPU_PREFILL_WITH_DECODES = 2048
# What the offline LLM class asks for: no bound beyond the step's budget. A batch job reads
# no token before its request ends, and each step a prompt is spread over runs the whole
# model once more: `pagedlm bench throughput` on 64 ShareGPT requests ran 1.12x faster
# without the 64-token bound (benchmarks/results/engine_core/epyc_offline_prefill_bound/).
UNBOUNDED_PREFILL_WITH_DECODES = 2**62


def check_max_model_len(max_model_len: int | None, model_max: int) -> None:
    """A max_model_len asked for must fit the model's own context (`model_max`)."""
    if max_model_len is not None and max_model_len > model_max:
        raise ValueError(
            f"max_model_len ({max_model_len}) is larger than the model's context "
            f"({model_max} tokens)"
        )


# Tokens one step may batch, by default. On CPU, 512: the most the C++ decoder of Llama-family
# models takes in a step (models/llama_cpu_decode.py), and small enough that a step's
# activations stay in cache. A longer prompt is then prefilled in chunks of 512 through that
# decoder, 1.07-1.09x faster than in one step through the Python layers at 1000-2000 tokens
# (with the Python layers alone, the chunks measured the same; benchmarks/cpu/prefill_chunks.py),
# and offline ShareGPT-64 ran a median 1.06x faster, served no slower
# (benchmarks/results/engine_core/zen5_batched_tokens_512/).
DEFAULT_CPU_BATCHED_TOKENS = 512
DEFAULT_GPU_BATCHED_TOKENS = 8192


def max_num_batched_tokens(args: EngineArgs, device_type: str, model_max: int) -> int:
    """The step's token budget: the user's, else the device's default; with chunked prefill
    off, at least the context (a whole prompt must fit one step)."""
    if args.max_num_batched_tokens:
        return args.max_num_batched_tokens
    default = DEFAULT_CPU_BATCHED_TOKENS if device_type == "cpu" else DEFAULT_GPU_BATCHED_TOKENS
    if not args.enable_chunked_prefill:
        return max(default, args.max_model_len or model_max)
    return default


def profile_num_blocks(executor: Executor, spec: WorkerSpec, max_batched: int,
                       max_model_len: int) -> int:
    """The KV blocks the memory left after a profiled step of `max_batched` tokens holds.
    Profiled at the context served: a fabricated prompt longer than max_model_len would
    run positions past the rotary tables the model was built with."""
    num_blocks = executor.determine_num_blocks(max_batched, max_model_len)
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget holds no block: one block of {spec.block_size} tokens "
            f"needs {spec.block_bytes} bytes; raise kv_cache_memory or gpu_memory_utilization"
        )
    return num_blocks


def served_max_model_len(max_model_len: int | None, kv_cache_manager: KVCacheManager,
                         model_max: int, max_batched: int, num_blocks: int) -> int:
    """The context served: max_model_len if the cache can hold it, else the model's
    context as far as the cache holds it."""
    capacity = kv_cache_manager.capacity_tokens
    if kv_cache_manager.can_ever_fit(model_max, max_batched):
        capacity = max(capacity, model_max)  # a window bounds the blocks held
    if max_model_len is None:
        return min(model_max, capacity)
    if max_model_len > capacity:
        raise ValueError(
            f"max_model_len ({max_model_len}) is larger than the KV cache can hold "
            f"({capacity} tokens in {num_blocks} blocks); lower "
            f"max_model_len or give the cache more memory"
        )
    return max_model_len


def scheduler_config(args: EngineArgs, device_type: str, max_batched: int,
                     max_model_len: int) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max_batched,
        max_model_len=max_model_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        max_prefill_tokens_with_decodes=min(max_batched, (
            args.max_prefill_tokens_with_decodes
            or (DEFAULT_CPU_PREFILL_WITH_DECODES if device_type == "cpu"
                else DEFAULT_GPU_PREFILL_WITH_DECODES))),
    )
