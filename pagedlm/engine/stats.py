from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's KV memory and queues."""

    num_blocks_total: int
    num_blocks_free: int  # blocks no request references
    block_size: int
    num_tokens_held: int  # tokens whose K/V are in the cache for live requests
    num_preemptions: int  # since start
    num_requests_running: int
    num_requests_waiting: int
    prefix_cache_queries: int = 0  # prompt tokens looked up (prefix caching)
    prefix_cache_hits: int = 0  # prompt tokens found
    num_prompt_tokens: int = 0  # computed since start (recomputation included)
    num_generation_tokens: int = 0  # sampled since start
    num_steps: int = 0

    @property
    def num_blocks_used(self) -> int:
        return self.num_blocks_total - self.num_blocks_free

    @property
    def kv_cache_usage(self) -> float:
        return self.num_blocks_used / self.num_blocks_total


@dataclass(frozen=True)
class KVUsageSample:
    """One step's KV memory: slots in referenced blocks vs slots holding a token."""

    step: int
    allocated_slots: int
    tokens_held: int
    num_running: int
