"""Prometheus metrics at /metrics, named `pagedlm:*` with vLLM's suffixes; seconds as units.

Two sources:
  * engine gauges and counters (running / waiting requests, KV cache usage, preemptions,
    token counters) are read at scrape time from the engine thread's latest
    `EngineStats` snapshot, by a custom collector: no locking, never stale by more
    than one step;
  * per-request histograms (TTFT, inter-token latency, end-to-end latency, queue time)
    and `request_success_total{finished_reason}` are observed on the event loop from
    the RequestOutputs the async engine delivers (aborted requests included).

A registry per server (not prometheus' global one), so several apps can live in one
process (tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest as _generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.outputs import RequestOutput

PREFIX = "pagedlm:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                   30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator:
        stats = self.engine.stats
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        yield gauge("num_requests_running", "Sequences in the running batch.",
                    stats.num_requests_running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.",
                    stats.num_requests_waiting)
        yield gauge("kv_cache_usage_perc",
                    "KV cache usage: blocks referenced by requests over all blocks (0-1).",
                    stats.kv_cache_usage)
        yield counter("num_preemptions", "Preemptions since start.", stats.num_preemptions)
        yield counter("prompt_tokens", "Prompt tokens computed (prefill) since start.",
                      stats.num_prompt_tokens)
        yield counter("generation_tokens", "Tokens generated since start.",
                      stats.num_generation_tokens)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      stats.prefix_cache_hits)
        yield gauge("kv_blocks_shared", "KV blocks referenced by more than one sequence.",
                    stats.num_blocks_shared)
        yield gauge("kv_tokens_held", "Tokens whose K/V are cached for live sequences (shared once).",
                    stats.num_tokens_held)
        yield gauge("kv_tokens_held_unshared",
                    "Tokens live sequences would hold without block sharing.",
                    stats.num_tokens_held_unshared)
        yield counter("kv_block_copies", "Copy-on-write block copies since start.",
                      stats.num_block_copies)
        # Speculative decoding, with vLLM's names (zero when it is off).
        yield counter("spec_decode_num_drafts", "Speculative verifications: a request's drafts "
                      "checked in one step.", stats.spec_num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                      stats.spec_num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      stats.spec_num_accepted_tokens)
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position.",
                                      labels=["model_name", "position"])
        for position, count in enumerate(stats.spec_accepted_per_pos):
            per_pos.add_metric([self.model_name, str(position)], count)
        yield per_pos
        if stats.max_loras:  # LoRA, with vLLM's name: the value is when it was taken
            lora = GaugeMetricFamily(
                PREFIX + "lora_requests_info", "LoRA adapters of running and waiting requests.",
                labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
            lora.add_metric([",".join(stats.running_lora_adapters),
                             ",".join(stats.waiting_lora_adapters), str(stats.max_loras)],
                            time.time())
            yield lora
            yield counter("lora_loads", "LoRA adapters written into a slot since start.",
                          stats.num_lora_loads)
        info = InfoMetricFamily(PREFIX + "cache_config", "KV cache configuration.")
        info.add_metric([], {"num_blocks": str(stats.num_blocks_total),
                             "block_size": str(stats.block_size)})
        yield info


class ServerMetrics:
    """Owns the registry; `observe` is the async engine's output listener."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first token, seconds.",
            TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between consecutive tokens of a request, seconds.",
            ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from arrival to finish, seconds.",
            REQUEST_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Time from arrival to first scheduled, seconds.",
            REQUEST_BUCKETS)
        self._request_success = Counter(
            PREFIX + "request_success", "Finished sequences by finish reason.",
            labels + ["finished_reason"], registry=self.registry)
        self.registry.register(_EngineCollector(engine, model_name))
        # request id -> time of its last token, to measure the gap to the next one.
        self._last_token_time: dict[str, float] = {}
        # Who else wants each latency as it is measured (the dashboard's charts): a
        # request's time to first token when it arrives, and each inter-token gap.
        self.first_token_listeners: list[Callable[[float], None]] = []
        self.token_gap_listeners: list[Callable[[float], None]] = []

    def observe(self, output: RequestOutput) -> None:
        metrics = output.metrics
        if metrics is None:
            return
        request_id = output.request_id
        if metrics.last_token_time is not None:
            previous = self._last_token_time.get(request_id)
            if previous is None:
                if metrics.first_token_time is not None:
                    for listener in self.first_token_listeners:
                        listener(metrics.first_token_time - metrics.arrival_time)
            elif metrics.last_token_time > previous:
                gap = metrics.last_token_time - previous
                self.inter_token_latency.observe(gap)
                for listener in self.token_gap_listeners:
                    listener(gap)
            self._last_token_time[request_id] = metrics.last_token_time
        if not output.finished:
            return
        self._last_token_time.pop(request_id, None)
        if metrics.time_to_first_token is not None:
            self.time_to_first_token.observe(metrics.time_to_first_token)
        if metrics.time_in_queue is not None:
            self.request_queue_time.observe(metrics.time_in_queue)
        if metrics.finished_time is not None:
            self.e2e_request_latency.observe(metrics.finished_time - metrics.arrival_time)
        for completion in output.outputs:
            reason = completion.finish_reason or "abort"
            self._request_success.labels(self.model_name, reason).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return _generate_latest(self.registry), CONTENT_TYPE_LATEST
