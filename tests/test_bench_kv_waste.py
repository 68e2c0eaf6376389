"""The KV waste report on hand-made traces, with fractions worked out by hand."""

from __future__ import annotations

import pytest

from pagedlm.benchmarks.kv_usage import (
    RESERVE_MAX,
    RESERVE_ORACLE,
    measured_waste,
    simulate_kv_usage,
)
from pagedlm.engine.stats import KVUsageSample

approx = pytest.approx

# Request A: 3 prompt + 2 output tokens; request B: 5 prompt + 1 output token.
# Block size 4, max_model_len 8, both live from the start:
#   step 1: A holds 3, B holds 5  -> tokens 8; paged 4+8=12; reserve 8+8=16; oracle 5+6=11
#   step 2: A holds 4 (B is gone) -> tokens 4; paged 4;      reserve 8;      oracle 5
TRACE = [(3, 2), (5, 1)]


def test_hand_made_trace_all_at_once() -> None:
    r = simulate_kv_usage(TRACE, [4], max_model_len=8)
    assert r["num_steps"] == 2
    assert r["token_steps"] == 12
    assert r["allocated_slot_steps"] == {"paged_bs4": 16, RESERVE_MAX: 24, RESERVE_ORACLE: 16}
    assert r["waste"] == {"paged_bs4": approx(1 - 12 / 16), RESERVE_MAX: approx(1 - 12 / 24),
                          RESERVE_ORACLE: approx(1 - 12 / 16)}
    assert r["mean_step_waste"]["paged_bs4"] == approx((4 / 12 + 0) / 2)
    assert r["mean_step_waste"][RESERVE_MAX] == approx(0.5)
    assert r["mean_step_waste"][RESERVE_ORACLE] == approx((3 / 11 + 1 / 5) / 2)
    assert r["series"] == {"step": [1, 2], "tokens_held": [8, 4], "num_running": [2, 1],
                           "paged_bs4": [12, 4], RESERVE_MAX: [16, 8], RESERVE_ORACLE: [11, 5]}


def test_one_at_a_time_keeps_the_slot_step_waste() -> None:
    # step 1: A 3 (paged 4), step 2: A 4 (4), step 3: B 5 (8).
    r = simulate_kv_usage(TRACE, [4], max_model_len=8, max_num_seqs=1)
    assert r["num_steps"] == 3
    assert r["series"]["tokens_held"] == [3, 4, 5]
    assert r["series"]["paged_bs4"] == [4, 4, 8]
    assert r["series"][RESERVE_ORACLE] == [5, 5, 6]
    # The slot-step waste does not depend on the schedule; the per-step mean does.
    assert r["waste"]["paged_bs4"] == approx(0.25)
    assert r["waste"][RESERVE_MAX] == approx(0.5)
    assert r["mean_step_waste"]["paged_bs4"] == approx((1 / 4 + 0 + 3 / 8) / 3)


def test_block_size_one_wastes_nothing_and_sizes_order() -> None:
    trace = [(17, 30), (100, 3), (1, 1), (64, 64)]
    r = simulate_kv_usage(trace, [1, 8, 16, 32], max_model_len=256, max_num_seqs=2)
    assert r["waste"]["paged_bs1"] == 0.0
    w = r["waste"]
    assert 0 < w["paged_bs8"] < w["paged_bs16"] < w["paged_bs32"] < w[RESERVE_MAX]


def test_series_is_downsampled() -> None:
    r = simulate_kv_usage([(1, 500)], [16], max_model_len=512, max_series_points=50)
    assert r["num_steps"] == 500
    assert len(r["series"]["step"]) == 50
    assert r["series"]["step"][0] == 1 and r["series"]["step"][-1] == 500


@pytest.mark.parametrize("trace, kwargs, message", [
    ([], {}, "no requests"),
    ([(5, 5)], {"max_model_len": 9}, "max_model_len"),
    ([(0, 5)], {}, "at least one"),
    ([(1, 1)], {"block_sizes": [0]}, "block sizes"),
    ([(1, 1)], {"max_num_seqs": 0}, "max_num_seqs"),
])
def test_bad_traces_are_refused(trace: list, kwargs: dict, message: str) -> None:
    args = {"block_sizes": [4], "max_model_len": 64, **kwargs}
    with pytest.raises(ValueError, match=message):
        simulate_kv_usage(trace, **args)


def test_measured_waste_from_a_recording() -> None:
    samples = [
        KVUsageSample(step=1, allocated_slots=32, tokens_held=20, num_running=2),
        KVUsageSample(step=2, allocated_slots=32, tokens_held=24, num_running=2),
        KVUsageSample(step=3, allocated_slots=0, tokens_held=0, num_running=0),
    ]
    m = measured_waste(samples)
    assert m["waste"] == approx(1 - 44 / 64)
    assert m["mean_step_waste"] == approx((12 / 32 + 8 / 32) / 2)  # empty steps are skipped
    assert m["peak_allocated_slots"] == 32
    assert m["series"]["allocated_slots"] == [32, 32, 0]
