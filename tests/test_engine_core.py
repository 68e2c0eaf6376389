"""EngineCore on its own: token ids in and out, sequences of a request tracked by user id,
every block back after aborts and stops."""

from __future__ import annotations

import pytest

from pagedlm.config import EngineArgs
from pagedlm.engine.core import EngineCore
from pagedlm.engine.core_io import CoreRequest, sequence_ids
from pagedlm.loader.model_loader import resolve_model_source
from pagedlm.sampling_params import SamplingParams

PROMPT = [5, 17, 42, 99, 7, 3, 11]


@pytest.fixture(scope="module")
def core(tiny_llama_dir):
    args = EngineArgs(model=tiny_llama_dir, skip_tokenizer_init=True, kv_cache_memory=8 << 20,
                      max_model_len=256)
    core = EngineCore(args, resolve_model_source(tiny_llama_dir), eos_token_ids=(2,))
    yield core
    core.shutdown()


def _request(request_id: str, num_seqs: int, max_tokens: int = 20) -> CoreRequest:
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    return CoreRequest(request_id, PROMPT, params, seeds=list(range(num_seqs)),
                       max_tokens=max_tokens, arrival_time=0.0)


def _all_blocks_free(core: EngineCore) -> bool:
    kv = core.kv_cache_manager
    return kv.num_free_blocks == kv.num_blocks and not core.has_unfinished_requests()


def test_samples_run_as_sequences_and_an_abort_reaches_them_all(core):
    core.add_request(_request("a", 3))
    seen: dict[str, list[int]] = {}
    while len(seen) < 3 or min(len(t) for t in seen.values()) < 2:
        out = core.step()
        core.scheduler.check_invariants()
        for o in out.outputs:
            seen.setdefault(o.seq_id, []).append(o.token_id)
    assert sorted(seen) == sorted(sequence_ids("a", 3))
    core.abort_requests(["a"])
    assert _all_blocks_free(core)
    assert core.step().outputs == []


def test_a_stopped_sequence_ends_alone(core):
    core.add_request(_request("b", 2, max_tokens=6))
    first, second = sequence_ids("b", 2)
    counts = {first: 0, second: 0}
    stopped = False
    while core.has_unfinished_requests():
        out = core.step()
        for o in out.outputs:
            counts[o.seq_id] += 1
            if o.seq_id == second and counts[second] == 2 and not stopped:
                core.finish_sequences([second])  # as the frontend does on a stop string
                stopped = True
        core.scheduler.check_invariants()
    assert counts == {first: 6, second: 2}
    assert _all_blocks_free(core)


def test_refused_requests_leave_nothing_behind(core):
    with pytest.raises(ValueError, match="max_model_len"):
        core.add_request(_request("c", 1, max_tokens=1000))
    core.add_request(_request("d", 1, max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request(_request("d", 1))
    while core.has_unfinished_requests():
        last = core.step()
    assert last.outputs[-1].finish_reason == "length" and last.outputs[-1].seq_id == "d"
    assert _all_blocks_free(core)
