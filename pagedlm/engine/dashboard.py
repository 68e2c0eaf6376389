"""What the live dashboard shows, as the engine core sees it: one picklable snapshot.

Built by the core at most once per step, and only while someone watches (the core loop
asks for one every SNAPSHOT_PERIOD_S while a dashboard is open, and once on demand):

  * every KV block's state, one byte each, from the pool's `ref_counts` and `hashed`
    arrays (kept as references change) by vector operations: no walk over the blocks;
  * the running and waiting sequences, each with its progress, timing and block table
    (the page derives owners and tokens held per block from the tables);
  * the engine's counters (EngineStats) and what building snapshots has cost so far
    against the time spent stepping, so the overhead is visible where it is paid.
"""

from __future__ import annotations

import base64
import itertools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from pagedlm.core.block_states import STATE_NAMES, block_states, state_counts
from pagedlm.core.kv_cache_manager import KVCacheManager
from pagedlm.core.request import Request, RequestStatus
from pagedlm.core.scheduler import Scheduler
from pagedlm.engine.stats import EngineStats

SNAPSHOT_PERIOD_S = 0.25  # while a dashboard is open and the engine is busy: 4 per second


@dataclass
class SequenceRow:
    """One sequence (a request, one of its n samples, or a beam)."""

    seq_id: str
    request_id: str  # the user request it belongs to (groups n > 1 and beams)
    kind: str  # "sample" or "beam"
    state: str  # "running", "waiting", "preempted", "paused"
    prompt_tokens: int
    computed_tokens: int
    cached_prompt_tokens: int  # found in the prefix cache at admission
    output_tokens: int
    age_s: float  # since arrival
    queue_s: float | None  # arrival to first scheduled
    ttft_s: float | None  # arrival to first token
    preemptions: int
    block_ids: list[int] = field(default_factory=list)


@dataclass
class DashboardSnapshot:
    time: float  # time.time() when built
    step: int
    block_size: int
    block_states: bytes  # uint8 per block: a state above, | CACHED_FLAG
    ref_counts: bytes  # uint8 per block, saturated at 255
    sequences: list[SequenceRow]
    stats: EngineStats
    copies: list[tuple[int, int]]  # the last step's copy-on-write (src, dst) block ids
    build_seconds_total: float  # spent building snapshots since start
    step_seconds_total: float  # spent in steps since start
    num_snapshots: int

    def states(self) -> np.ndarray:
        return np.frombuffer(self.block_states, dtype=np.uint8)

    def to_json(self) -> dict:
        """For /dashboard/state and the event stream: bytes as base64."""
        d = asdict(self)
        d["block_states"] = base64.b64encode(self.block_states).decode()
        d["ref_counts"] = base64.b64encode(self.ref_counts).decode()
        d["stats"]["kv_cache_usage"] = self.stats.kv_cache_usage
        d["stats"]["prefix_cache_hit_rate"] = self.stats.prefix_cache_hit_rate
        d["stats"]["spec_acceptance_rate"] = self.stats.spec_acceptance_rate
        d["stats"]["spec_mean_acceptance_length"] = self.stats.spec_mean_acceptance_length
        d["state_names"] = list(STATE_NAMES)
        d["counts"] = state_counts(self.states())
        return d


def sequence_row(request: Request, request_id: str, kind: str, block_ids: list[int],
                 now: float) -> SequenceRow:
    if request.paused:
        state = "paused"
    elif request.status == RequestStatus.RUNNING:
        state = "running"
    elif request.status == RequestStatus.PREEMPTED:
        state = "preempted"
    else:
        state = "waiting"
    arrival = request.arrival_time
    return SequenceRow(
        seq_id=request.request_id, request_id=request_id, kind=kind, state=state,
        prompt_tokens=request.num_prompt_tokens, computed_tokens=request.num_computed_tokens,
        cached_prompt_tokens=request.num_cached_prompt_tokens,
        output_tokens=request.num_output_tokens, age_s=now - arrival,
        queue_s=(None if request.first_scheduled_time is None
                 else request.first_scheduled_time - arrival),
        ttft_s=None if request.first_token_time is None else request.first_token_time - arrival,
        preemptions=request.num_preemptions, block_ids=block_ids)


def build_snapshot(kv: KVCacheManager, sched: Scheduler, copies: list[tuple[int, int]],
                   owner_of: Callable[[str], tuple[str, str]], stats: EngineStats,
                   step_seconds: float) -> DashboardSnapshot:
    """The snapshot of an engine core's cache and scheduler (its own cost counters are
    filled in by the core). `copies`: the last step's copy-on-write (src, dst) block ids;
    `owner_of(seq_id)`: the user request id and kind ("sample", "beam") of a sequence."""
    states = block_states(kv.block_pool, [dst for _, dst in copies])
    refs = np.minimum(kv.block_pool.ref_counts, 255).astype(np.uint8)
    now = time.monotonic()
    rows = []
    pending = [f for followers in sched.pending_forks.values() for f in followers]
    for request in itertools.chain(sched.running, sched.waiting, pending):
        seq_id = request.request_id
        parent, kind = owner_of(seq_id)
        rows.append(sequence_row(request, parent, kind, kv.get_block_ids(seq_id), now))
    return DashboardSnapshot(
        time=time.time(), step=stats.num_steps, block_size=kv.block_size,
        block_states=states.tobytes(), ref_counts=refs.tobytes(), sequences=rows, stats=stats,
        copies=copies, build_seconds_total=0.0, step_seconds_total=step_seconds,
        num_snapshots=0)
