"""The dashboard's snapshot (engine/dashboard.py, core/block_states.py): every block's state
equals the one derived from the block objects, sequences are grouped under their request,
and the core loop sends snapshots only while someone watches."""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest

from pagedlm.config import EngineArgs
from pagedlm.core.block_pool import BlockPool
from pagedlm.core.block_states import (
    CACHED_FLAG,
    COPYING,
    EVICTABLE,
    FREE,
    OWNED,
    RESERVED,
    SHARED,
    block_state_of,
    block_states,
)
from pagedlm.engine.core import EngineCore
from pagedlm.engine.core_client import (
    AddCommand,
    CoreMessage,
    DashboardCommand,
    ShutdownCommand,
    run_core_loop,
)
from pagedlm.engine.core_io import CoreRequest, sequence_ids
from pagedlm.loader.model_loader import resolve_model_source
from pagedlm.sampling_params import SamplingParams


def _reference(pool: BlockPool, copy_dsts: list[int]) -> list[int]:
    return [block_state_of(b, pool, set(copy_dsts)) for b in pool.blocks]


def test_every_state_and_the_cached_flag():
    pool = BlockPool(8, enable_caching=True, reserve_null_block=True)
    a, b, c, d = pool.get_new_blocks(4)  # ids 1..4 (0 is the null block)
    pool.touch([b])  # shared by two
    pool.touch([b])  # by three
    pool.cache_block(c, b"hash-c")  # an owned prefix-cache entry
    pool.cache_block(d, b"hash-d")
    pool.free_blocks([d])  # free but still cached: evictable
    states = block_states(pool, copy_dsts=[a.block_id])
    assert states.tolist() == _reference(pool, [a.block_id])
    assert states[0] == RESERVED
    assert states[a.block_id] == COPYING
    assert states[b.block_id] == SHARED and pool.ref_counts[b.block_id] == 3
    assert states[c.block_id] == OWNED | CACHED_FLAG
    assert states[d.block_id] == EVICTABLE | CACHED_FLAG
    assert set(states[5:].tolist()) == {FREE}
    pool.check_invariants()  # which compares block_states with block_state_of as well
    # Eviction clears the flag: handing d out again for new content.
    pool.get_new_blocks(pool.num_free_blocks)
    assert block_states(pool, []).tolist() == _reference(pool, [])
    assert not np.any(block_states(pool, []) & CACHED_FLAG & (pool.ref_counts == 0))


def test_a_copy_destination_already_freed_is_not_copying():
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    assert block_states(pool, [a.block_id])[a.block_id] == FREE


@pytest.fixture(scope="module")
def core(tiny_llama_dir):
    args = EngineArgs(model=tiny_llama_dir, skip_tokenizer_init=True, kv_cache_memory=8 << 20,
                      max_model_len=256, enable_prefix_caching=True)
    core = EngineCore(args, resolve_model_source(tiny_llama_dir), eos_token_ids=(2,))
    yield core
    core.shutdown()


def _request(request_id: str, prompt: list[int], num_seqs: int = 1,
             max_tokens: int = 8) -> CoreRequest:
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    return CoreRequest(request_id, prompt, params, seeds=list(range(num_seqs)),
                       max_tokens=max_tokens, arrival_time=time.monotonic())


def test_snapshot_of_a_running_engine(core):
    prompt = list(range(3, 3 + 40))  # two full blocks of 16 and a partial one
    core.add_request(_request("forked", prompt, num_seqs=3))
    core.add_request(_request("alone", prompt[:20]))
    for _ in range(3):
        core.step()
    snap = core.dashboard_snapshot()
    snap = pickle.loads(pickle.dumps(snap))  # it crosses the pipe from the core process
    pool = core.kv_cache_manager.block_pool
    copies = [dst for _, dst in snap.copies]
    assert snap.states().tolist() == _reference(pool, copies)
    rows = {r.seq_id: r for r in snap.sequences}
    assert set(rows) == set(sequence_ids("forked", 3)) | set(sequence_ids("alone", 1))
    for seq_id in sequence_ids("forked", 3):
        row = rows[seq_id]
        assert row.request_id == "forked" and row.kind == "sample"
        assert row.state == "running" and row.prompt_tokens == 40
        assert row.output_tokens >= 1 and row.ttft_s is not None and row.queue_s is not None
        assert row.block_ids == core.kv_cache_manager.get_block_ids(seq_id)
    # The three samples share the prompt's full blocks.
    tables = [rows[s].block_ids for s in sequence_ids("forked", 3)]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    states = snap.states()
    assert all(states[b] & 7 == SHARED for b in tables[0][:2])
    counts = snap.to_json()["counts"]
    assert counts["shared"] == int(np.count_nonzero((states & 7) == SHARED))
    assert sum(counts[k] for k in ("free", "evictable", "owned", "shared", "copying",
                                   "reserved")) == core.kv_cache_manager.num_blocks
    assert snap.stats.num_requests_running == 4
    assert snap.num_snapshots >= 1 and snap.build_seconds_total > 0
    assert snap.step_seconds_total > 0
    core.abort_requests(["forked", "alone"])
    after = core.dashboard_snapshot()
    assert after.sequences == []
    assert set((after.states() & 7).tolist()) <= {FREE, EVICTABLE}
    # What stays cached after the aborts is marked evictable, the rest free.
    assert after.to_json()["counts"]["evictable"] == len(pool.cached_blocks)


def test_core_loop_sends_snapshots_only_to_watchers(core):
    """No snapshot without a dashboard; one on demand; a stream while one is open."""
    inbox = [[AddCommand(_request("x", list(range(5, 30)), max_tokens=30))]]
    sent: list[CoreMessage] = []
    steps = {"n": 0}

    def recv(block: bool) -> list:
        steps["n"] += 1
        if inbox:
            return inbox.pop(0)
        if steps["n"] == 4:
            return [DashboardCommand(0)]  # one snapshot, now
        if steps["n"] == 8:
            return [DashboardCommand(+1)]  # a dashboard opens
        if not core.has_unfinished_requests():
            return [ShutdownCommand()]
        return []

    run_core_loop(core, recv, sent.append, None)
    with_snapshot = [i for i, m in enumerate(sent) if m.dashboard is not None]
    assert with_snapshot, "no snapshot at all"
    first = with_snapshot[0]
    assert all(m.dashboard is None for m in sent[:first])
    # The one-off snapshot, then (after the dashboard opened) more, and a last one when
    # the engine went idle showing every sequence gone.
    assert len(with_snapshot) >= 3
    assert sent[with_snapshot[-1]].dashboard.sequences == []
