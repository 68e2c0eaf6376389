"""`pagedlm bench serving`: load an OpenAI-compatible server and measure what clients see.

Requests arrive as a Poisson process: gaps between sends are exponential with mean
1 / request_rate, drawn from a seeded RNG, so a run is reproducible; an infinite rate
sends everything at once.  ``--max-concurrency`` caps requests in flight (a request due
while the cap is reached waits, and its latencies count from when it is really sent).
Each request streams /v1/completions; see :mod:`pagedlm.benchmarks.metrics` for what is
measured.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from tqdm.auto import tqdm

from pagedlm.benchmarks.common import read_json, result_header, write_json
from pagedlm.benchmarks.dataset_args import build_requests, dataset_info
from pagedlm.benchmarks.datasets import SampleRequest
from pagedlm.benchmarks.metrics import RequestRecord, compute_serving_metrics
from pagedlm.entrypoints.bench_client import CompletionsClient, list_models
from pagedlm.loader.gguf_loader import default_model_path
from pagedlm.loader.tokenizer import load_tokenizer

T = TypeVar("T")

SendFn = Callable[[SampleRequest], Awaitable[RequestRecord]]


def arrival_offsets(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request is sent.

    Poisson arrivals: the first request goes at 0 and each next one an Exp(request_rate)
    gap later; ``inf`` sends every request at 0.
    """
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(num_requests):
        if i > 0:
            t += rng.expovariate(request_rate)
        offsets.append(t)
    return offsets


async def run_requests(send: SendFn, requests: Sequence[SampleRequest],
                       offsets: Sequence[float], max_concurrency: int | None = None,
                       on_done: Callable[[], None] | None = None,
                       ) -> tuple[list[RequestRecord], float]:
    """Send each request at its offset (respecting ``max_concurrency``); returns the
    records in request order and the wall time from the start to the last response."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(request: SampleRequest, offset: float) -> RequestRecord:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is None:
            record = await send(request)
        else:
            async with limit:
                record = await send(request)
        if on_done is not None:
            on_done()
        return record

    records = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))
    return list(records), time.perf_counter() - start


def format_report(metrics: dict[str, Any]) -> str:
    """The human-readable summary printed at the end of a run."""
    lines = [
        f"{'Successful requests:':<36}{metrics['completed']:>12}",
        f"{'Failed requests:':<36}{metrics['failed']:>12}",
        f"{'Benchmark duration (s):':<36}{metrics['duration_s']:>12.2f}",
        f"{'Total input tokens:':<36}{metrics['total_input_tokens']:>12}",
        f"{'Total output tokens:':<36}{metrics['total_output_tokens']:>12}",
        f"{'Request throughput (req/s):':<36}{metrics['request_throughput']:>12.2f}",
        f"{'Output token throughput (tok/s):':<36}{metrics['output_throughput']:>12.2f}",
        f"{'Total token throughput (tok/s):':<36}{metrics['total_token_throughput']:>12.2f}",
    ]
    if "client_cpu_s" in metrics:
        lines.append(f"{'Client CPU during the run (s):':<36}{metrics['client_cpu_s']:>12.2f}")
    names = {"ttft_ms": "Time to first token", "tpot_ms": "Time per output token",
             "itl_ms": "Inter-token latency", "e2el_ms": "End-to-end latency"}
    for key, title in names.items():
        lines.append(f"---- {title} (ms) ----")
        for stat, value in metrics[key].items():
            if stat in ("count", "std") or (stat == "median" and "p50" in metrics[key]):
                continue
            lines.append(f"{stat:<36}{value:>12.2f}")
    for error, count in metrics["errors"].items():
        lines.append(f"error x{count}: {error}")
    return "\n".join(lines)


async def _benchmark(args: argparse.Namespace, requests: list[SampleRequest]
                     ) -> tuple[str, list[RequestRecord], float, float]:
    """The model's name, the records, the run's wall time and this client's CPU seconds
    during it (what it took from the server on a shared machine)."""
    model = args.model or (await list_models(args.base_url, args.api_key))[0]
    async with CompletionsClient(args.base_url, model, api_key=args.api_key,
                                 ignore_eos=args.ignore_eos, temperature=args.temperature,
                                 top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                 timeout_s=args.request_timeout,
                                 max_connections=args.max_concurrency) as client:
        # One short request first, so a wrong URL, model or key fails with its reason
        # instead of as N identical failures.
        probe = await client.send(replace(requests[0], output_len=min(4, requests[0].output_len)))
        if not probe.success:
            raise ValueError(f"the test request to {client.url} failed: {probe.error}")
        bar = None
        if not args.disable_tqdm:
            bar = tqdm(total=len(requests), desc="Requests")
        offsets = arrival_offsets(len(requests), args.request_rate, args.seed)
        cpu_start = time.process_time()
        try:
            records, duration = await run_requests(
                client.send, requests, offsets, args.max_concurrency,
                on_done=(lambda: bar.update(1)) if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        client_cpu_s = time.process_time() - cpu_start
    return model, records, duration, client_cpu_s


def _tokenizer(path: str | None) -> Any:
    try:
        return load_tokenizer(path if path is not None else default_model_path())
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None


def _run_loop(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run, on uvloop where it is installed (a dependency except on Windows): the
    client shares the machine with the server it measures, and uvloop's loop cost it about
    a sixth less CPU per token than asyncio's in a ShareGPT-64 run at rate inf (32-34
    against 37-40 us, `benchmarks/cpu/serving_cpu_split.py`)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def main(args: argparse.Namespace) -> int:
    """Run `pagedlm bench serving`; returns the exit status."""
    server = read_json(args.server_info) if args.server_info else None
    tokenizer = _tokenizer(args.tokenizer)
    requests = build_requests(args, tokenizer, len(tokenizer))
    model, records, duration, client_cpu_s = _run_loop(_benchmark(args, requests))
    metrics = compute_serving_metrics(records, duration, args.percentiles)
    metrics["client_cpu_s"] = client_cpu_s
    print(format_report(metrics))
    report = result_header(
        "serving", model=model, dtype=args.dtype, dataset=args.dataset, num_prompts=len(requests),
        seed=args.seed, threads=None, base_url=args.base_url,
        label=args.label or model, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        dataset_info=dataset_info(args),
    )
    if server is not None:
        report["server"] = server
    report["results"] = metrics
    if args.output_json:
        print(f"wrote {write_json(args.output_json, report)}")
    return 0 if metrics["completed"] else 1
