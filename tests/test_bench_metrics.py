"""Serving-benchmark metrics on a synthetic stream with known times, arrivals, SSE parsing."""

from __future__ import annotations

import asyncio
import math

import pytest

from pagedlm.benchmarks.datasets import SampleRequest
from pagedlm.benchmarks.metrics import (
    RequestRecord,
    compute_serving_metrics,
    request_itls,
    request_tpot,
    summarize,
)
from pagedlm.benchmarks.serving import arrival_offsets, format_report, run_requests

approx = pytest.approx

# Three successful requests and one failure over a 4 s run:
#   r1: sent 0.0, chunks 0.5 0.7 1.0, done 1.1, 4 tokens -> TTFT .5, E2E 1.1, TPOT .6/3, ITL .2 .3
#   r2: sent 1.0, chunk 1.2, done 1.25, 1 token          -> TTFT .2, E2E .25, no TPOT, no ITL
#   r3: sent 2.0, chunks 2.1 2.2 2.6, done 2.6, 5 tokens -> TTFT .1, E2E .6, TPOT .5/4, ITL .1 .4
#       (a chunk may carry several tokens: TPOT is per token, ITL per chunk)
RECORDS = [
    RequestRecord(0.0, (0.5, 0.7, 1.0), 1.1, prompt_len=10, output_tokens=4),
    RequestRecord(1.0, (1.2,), 1.25, prompt_len=6, output_tokens=1),
    RequestRecord(2.0, (2.1, 2.2, 2.6), 2.6, prompt_len=4, output_tokens=5),
    RequestRecord(3.0, (), 3.1, prompt_len=9, output_tokens=0, success=False,
                  error="HTTP 500: boom"),
]


def test_per_request_figures() -> None:
    assert request_tpot(RECORDS[0]) == approx(0.2)
    assert request_tpot(RECORDS[1]) is None
    assert request_tpot(RECORDS[2]) == approx(0.125)
    assert request_itls(RECORDS[0]) == approx([0.2, 0.3])
    assert request_itls(RECORDS[1]) == []


def test_serving_metrics_exact_values() -> None:
    m = compute_serving_metrics(RECORDS, duration_s=4.0)
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["errors"] == {"HTTP 500: boom": 1}
    assert m["total_input_tokens"] == 20 and m["total_output_tokens"] == 10
    assert m["request_throughput"] == approx(0.75)
    assert m["output_throughput"] == approx(2.5)
    assert m["total_token_throughput"] == approx(7.5)

    # Percentiles interpolate linearly: p99 of sorted [100, 200, 500] sits at rank 1.98.
    ttft = m["ttft_ms"]
    assert ttft["count"] == 3
    assert ttft["mean"] == approx(800 / 3)
    assert ttft["median"] == approx(200) and ttft["p50"] == approx(200)
    assert ttft["p90"] == approx(440) and ttft["p99"] == approx(494)

    tpot = m["tpot_ms"]
    assert tpot["count"] == 2
    assert tpot["mean"] == approx(162.5) and tpot["median"] == approx(162.5)
    assert tpot["p99"] == approx(125 + 0.99 * 75)

    itl = m["itl_ms"]  # pooled [200, 300, 100, 400]
    assert itl["count"] == 4
    assert itl["mean"] == approx(250) and itl["median"] == approx(250)
    assert itl["p99"] == approx(397)

    e2e = m["e2el_ms"]  # [1100, 250, 600]
    assert e2e["mean"] == approx(650) and e2e["median"] == approx(600)
    assert e2e["p99"] == approx(1090)
    assert "Failed requests:" in format_report(m)


def test_custom_percentiles_and_empty_samples() -> None:
    s = summarize([1.0, 2.0, 3.0, 4.0], percentiles=[25, 75], scale=10)
    assert s == {"count": 4, "mean": 25.0, "median": 25.0, "std": approx(11.180339887),
                 "p25": 17.5, "p75": 32.5}
    empty = summarize([], percentiles=[99])
    assert empty["count"] == 0 and math.isnan(empty["p99"])


def test_a_request_without_tokens_is_a_failure() -> None:
    m = compute_serving_metrics([RequestRecord(0.0, (), 1.0, 3, 0)], duration_s=1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["errors"] == {"no tokens streamed": 1}
    with pytest.raises(ValueError, match="duration_s"):
        compute_serving_metrics(RECORDS, 0.0)


def test_poisson_arrivals_are_seeded() -> None:
    a = arrival_offsets(2000, request_rate=4.0, seed=1)
    assert a == arrival_offsets(2000, request_rate=4.0, seed=1)
    assert a != arrival_offsets(2000, request_rate=4.0, seed=2)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    # Mean gap 1 / rate: 1999 gaps of mean .25 s, within 10%.
    assert a[-1] / 1999 == approx(0.25, rel=0.1)
    assert arrival_offsets(3, float("inf")) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request_rate"):
        arrival_offsets(3, 0.0)


def test_run_requests_keeps_order_and_respects_max_concurrency() -> None:
    in_flight = peak = 0

    async def send(req: SampleRequest) -> RequestRecord:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return RequestRecord(0.0, (0.001,), 0.01, req.prompt_len, req.output_len)

    reqs = [SampleRequest("", i + 1, 2, (1,) * (i + 1)) for i in range(7)]
    records, duration = asyncio.run(
        run_requests(send, reqs, [0.0] * 7, max_concurrency=2))
    assert [r.prompt_len for r in records] == [1, 2, 3, 4, 5, 6, 7]
    assert peak == 2 and duration > 0
    with pytest.raises(ValueError, match="max-concurrency"):
        asyncio.run(run_requests(send, reqs, [0.0] * 7, max_concurrency=0))


def test_sse_line_parsing() -> None:
    from pagedlm.entrypoints.bench_client import DONE, parse_sse_line

    assert parse_sse_line('data: {"choices": [{"text": "hi"}]}') == {"choices": [{"text": "hi"}]}
    assert parse_sse_line("data: [DONE]") is DONE
    assert parse_sse_line("") is None
    assert parse_sse_line(": keep-alive") is None
    assert "error" in parse_sse_line("data: {not json")
