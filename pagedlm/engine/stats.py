from __future__ import annotations

from dataclasses import dataclass


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
