"""Serving metrics as pure functions of what the client recorded per request.

For one request sent at ``send_time`` whose streamed chunks carrying tokens arrived at
``chunk_times`` and whose stream ended at ``end_time``:

    TTFT     = chunk_times[0] - send_time                     time to first token
    E2E      = end_time - send_time                           end-to-end latency
    TPOT     = (E2E - TTFT) / (output_tokens - 1)             time per output token,
                                                              only when output_tokens > 1
    ITL      = chunk_times[i] - chunk_times[i-1], i >= 1      inter-token latency, pooled
                                                              over all requests' chunks

A chunk may carry several tokens (a detokenizer holding back half a character), so ITL
is per chunk while TPOT is per token.  Percentiles interpolate linearly between order
statistics (numpy's default), so they are exact functions of the samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one request; times in seconds on one monotonic clock."""

    send_time: float
    chunk_times: tuple[float, ...]  # arrival of every streamed chunk that carried tokens
    end_time: float  # when the response was complete (or failed)
    prompt_len: int
    output_tokens: int
    success: bool = True
    error: str | None = None


def summarize(values: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES,
              scale: float = 1.0) -> dict[str, float | int]:
    """count, mean, median, std and ``p<q>`` for each percentile, each value times ``scale``.

    An empty sample gives count 0 and NaN statistics (written as "nan" in JSON).
    """
    out: dict[str, float | int] = {"count": len(values)}
    if not values:
        out.update({"mean": float("nan"), "median": float("nan"), "std": float("nan")})
        out.update({_pkey(q): float("nan") for q in percentiles})
        return out
    arr = np.asarray(values, dtype=np.float64) * scale
    out["mean"] = float(arr.mean())
    out["median"] = float(np.median(arr))
    out["std"] = float(arr.std())
    for q in percentiles:
        out[_pkey(q)] = float(np.percentile(arr, q))
    return out


def _pkey(q: float) -> str:
    return f"p{q:g}"


def request_ttft(r: RequestRecord) -> float:
    return r.chunk_times[0] - r.send_time


def request_latency(r: RequestRecord) -> float:
    return r.end_time - r.send_time


def request_tpot(r: RequestRecord) -> float | None:
    """(latency - TTFT) / (output_tokens - 1), or None for a single-token output."""
    if r.output_tokens <= 1:
        return None
    return (request_latency(r) - request_ttft(r)) / (r.output_tokens - 1)


def request_itls(r: RequestRecord) -> list[float]:
    t = r.chunk_times
    return [t[i] - t[i - 1] for i in range(1, len(t))]


def compute_serving_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, object]:
    """Aggregate metrics over a benchmark run lasting ``duration_s`` seconds.

    Only successful requests that streamed at least one token count towards latencies
    and token totals; the rest are failures.  Latency statistics are in milliseconds,
    throughputs per second of ``duration_s``.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in records if r.success and r.chunk_times]
    failed = [r for r in records if not (r.success and r.chunk_times)]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [t for t in (request_tpot(r) for r in ok) if t is not None]
    itls = [gap for r in ok for gap in request_itls(r)]
    errors: dict[str, int] = {}
    for r in failed:
        key = r.error or "no tokens streamed"
        errors[key] = errors.get(key, 0) + 1
    return {
        "completed": len(ok),
        "failed": len(failed),
        "errors": errors,
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "ttft_ms": summarize([request_ttft(r) for r in ok], percentiles, 1000.0),
        "tpot_ms": summarize(tpots, percentiles, 1000.0),
        "itl_ms": summarize(itls, percentiles, 1000.0),
        "e2el_ms": summarize([request_latency(r) for r in ok], percentiles, 1000.0),
    }
