"""What the engine reports about itself (EngineStats, and per step KVUsageSample when
recorded), and how each is read off the scheduler and the KV cache manager."""

from __future__ import annotations

from dataclasses import dataclass

from pagedlm.core.kv_cache_manager import KVCacheManager
from pagedlm.core.scheduler import Scheduler


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's KV memory and queues."""

    num_blocks_total: int
    num_blocks_free: int  # blocks no request references
    block_size: int
    num_tokens_held: int  # tokens whose K/V are in the cache for live requests (shared once)
    num_preemptions: int  # since start
    num_requests_running: int
    num_requests_waiting: int
    prefix_cache_queries: int = 0  # tokens looked up when requests are admitted
    prefix_cache_hits: int = 0  # tokens found in the prefix cache
    num_tokens_held_unshared: int = 0  # what num_tokens_held would be without any sharing
    num_blocks_shared: int = 0  # blocks referenced by more than one sequence
    num_block_copies: int = 0  # copy-on-write copies since start
    num_prompt_tokens: int = 0  # computed since start (recomputation included)
    num_generation_tokens: int = 0  # sampled since start
    num_steps: int = 0
    # Speculative decoding, since start: verifications (a request's drafts in one step),
    # draft tokens verified, drafts accepted, and drafts accepted at each draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # LoRA: slots, the adapters of running and of waiting requests (names, sorted), and
    # adapters written into a slot since start.
    max_loras: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    num_lora_loads: int = 0

    @property
    def num_blocks_used(self) -> int:
        return self.num_blocks_total - self.num_blocks_free

    @property
    def kv_cache_usage(self) -> float:
        return self.num_blocks_used / self.num_blocks_total

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted over proposed draft tokens (0 without speculation)."""
        return (self.spec_num_accepted_tokens / self.spec_num_draft_tokens
                if self.spec_num_draft_tokens else 0.0)

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens a verifying request got per step: accepted drafts plus one."""
        return (1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts
                if self.spec_num_drafts else 0.0)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(frozen=True)
class KVUsageSample:
    """One step's KV memory: slots in referenced blocks vs slots holding a token."""

    step: int
    allocated_slots: int
    tokens_held: int
    num_running: int
    tokens_held_unshared: int = 0


def tokens_held(kv: KVCacheManager, scheduler: Scheduler) -> int:
    """Tokens whose K/V the cache holds, a token shared by several sequences once."""
    return kv.num_distinct_tokens(scheduler.running)


def tokens_unshared(scheduler: Scheduler) -> int:
    """What the live sequences would hold if nothing were shared."""
    return sum(r.num_computed_tokens for r in scheduler.running)


def collect_stats(kv: KVCacheManager, scheduler: Scheduler, *, num_prompt_tokens: int,
                  num_generation_tokens: int, num_steps: int,
                  spec_fields: dict) -> EngineStats:
    """This moment's EngineStats; `spec_fields`: speculative decoding's counters, if any
    (SpecDecodeStats.engine_stats_fields)."""
    return EngineStats(
        num_blocks_total=kv.num_blocks,
        num_blocks_free=kv.num_free_blocks,
        block_size=kv.block_size,
        num_tokens_held=tokens_held(kv, scheduler),
        num_tokens_held_unshared=tokens_unshared(scheduler),
        num_blocks_shared=kv.num_shared_blocks(),
        num_block_copies=kv.num_copies,
        prefix_cache_queries=scheduler.prefix_cache_queries,
        prefix_cache_hits=scheduler.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions,
        num_requests_running=scheduler.num_running,
        num_requests_waiting=scheduler.num_waiting,
        num_prompt_tokens=num_prompt_tokens,
        num_generation_tokens=num_generation_tokens,
        num_steps=num_steps,
        **spec_fields,
        **(_lora_stats(scheduler) if scheduler.lora_slots is not None else {}),
    )


def _lora_stats(scheduler: Scheduler) -> dict:
    return dict(
        max_loras=scheduler.lora_slots.max_loras,
        running_lora_adapters=tuple(sorted({r.lora.name for r in scheduler.running
                                            if r.lora is not None})),
        waiting_lora_adapters=tuple(sorted({r.lora.name for r in scheduler.waiting
                                            if r.lora is not None})),
        num_lora_loads=scheduler.lora_slots.num_loads,
    )


def kv_usage_sample(step: int, kv: KVCacheManager, scheduler: Scheduler) -> KVUsageSample:
    return KVUsageSample(
        step=step,
        allocated_slots=kv.num_allocated_slots(),
        tokens_held=tokens_held(kv, scheduler),
        tokens_held_unshared=tokens_unshared(scheduler),
        num_running=scheduler.num_running,
    )
