"""The reliability suite's load tests, each against its own `pagedlm serve` on 127.0.0.1
(a tiny random Llama with SmolLM2's tokenizer, so the engine runs thousands of steps a
minute): a soak of concurrent streams, a disconnect storm, queue overflow, SIGTERM with
requests in flight, kill -9 and restart. Every test asserts: no 5xx, every accepted
request answered, every KV block back; the soak also asserts RSS growth under 5% after
warm-up. Bounded in count and time; see conftest.py for the knobs."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from collections import Counter

import pytest

from tests.server.conftest import TINY_ARGS, TINY_NAME, ServerProcess, metric_value
from tests.stress.conftest import env_float, env_int

httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):",
           "List three colours:", "Explain paged attention in one sentence.",
           " ".join(["word"] * 200)]


def _start(tmp_path, model_dir: str, *extra: str) -> ServerProcess:
    server = ServerProcess([model_dir, "--served-model-name", TINY_NAME, *TINY_ARGS, *extra],
                           tmp_path / "server.log")
    server.wait_healthy()
    return server


def _metrics(server: ServerProcess) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=10).text


def _assert_idle_and_all_blocks_back(server: ServerProcess, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        text = _metrics(server)
        busy = {name: metric_value(text, f"pagedlm:{name}") for name in
                ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")}
        if not any(busy.values()):
            return
        assert time.monotonic() < deadline, f"not idle after the load: {busy}"
        time.sleep(0.2)


def _rss_bytes(server: ServerProcess) -> int:
    """Resident memory of the server and its engine core process."""
    proc = psutil.Process(server.proc.pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


def _request(rng: random.Random, stream: bool) -> tuple[str, dict]:
    max_tokens = rng.choice([8, 32, 64, 128, 256])
    common = {"model": TINY_NAME, "max_tokens": max_tokens, "stream": stream,
              "temperature": rng.choice([0, 0.7, 1.0]), "seed": rng.randrange(1 << 30),
              "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.3:
        common["n"] = rng.choice([2, 3])
    if rng.random() < 0.5:
        return "/v1/chat/completions", {
            **common, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
    return "/v1/completions", {**common, "prompt": rng.choice(PROMPTS),
                               "logprobs": rng.choice([None, 2])}


async def _call(client, path: str, body: dict, stop_after_chunks: int | None = None) -> str:
    """One request; returns how it ended: "ok", "4xx", "503", "5xx", "cut" (we hung up)."""
    if not body["stream"]:
        r = await client.post(path, json=body)
        if r.status_code == 200:
            choices = r.json()["choices"]
            assert all(c["finish_reason"] in ("stop", "length") for c in choices), r.text
            return "ok"
        return _status_kind(r.status_code)
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return _status_kind(r.status_code)
        chunks, last = 0, None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            last = line[len("data: "):]
            chunks += 1
            if stop_after_chunks is not None and chunks >= stop_after_chunks:
                return "cut"
        assert last == "[DONE]", last
        return "ok"


def _status_kind(status: int) -> str:
    if status == 503:
        return "503"
    return "5xx" if status >= 500 else "4xx"


def test_concurrent_streams_soak(tmp_path, tiny_model_dir, report):
    num_streams = env_int("PAGEDLM_STRESS_STREAMS", 32)
    duration_s = env_float("PAGEDLM_STRESS_MINUTES", 3) * 60
    server = _start(tmp_path, tiny_model_dir, "--max-num-seqs", "64")
    try:
        outcomes: Counter = Counter()
        rss: dict[str, int] = {}

        async def worker(i: int, deadline: float) -> None:
            rng = random.Random(i)
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                while time.monotonic() < deadline:
                    path, body = _request(rng, stream=rng.random() < 0.7)
                    outcomes[await _call(client, path, body)] += 1

        async def sample_rss(start: float, deadline: float) -> None:
            await asyncio.sleep(min(60.0, (deadline - start) * 0.25))  # warm-up
            rss["after_warmup"] = _rss_bytes(server)
            peak = rss["after_warmup"]
            while time.monotonic() < deadline:
                await asyncio.sleep(1.0)
                peak = max(peak, _rss_bytes(server))
            rss["peak"] = peak

        async def main() -> None:
            start = time.monotonic()
            deadline = start + duration_s
            await asyncio.gather(sample_rss(start, deadline),
                                 *(worker(i, deadline) for i in range(num_streams)))

        t0 = time.monotonic()
        asyncio.run(main())
        elapsed = time.monotonic() - t0
        _assert_idle_and_all_blocks_back(server)
        rss["end"] = _rss_bytes(server)
        growth = (rss["peak"] - rss["after_warmup"]) / rss["after_warmup"]
        report(streams=num_streams, seconds=round(elapsed, 1), outcomes=dict(outcomes),
               requests_per_s=round(sum(outcomes.values()) / elapsed, 2),
               rss_after_warmup_mib=round(rss["after_warmup"] / 2**20, 1),
               rss_peak_mib=round(rss["peak"] / 2**20, 1), rss_growth_pct=round(100 * growth, 2),
               generation_tokens=metric_value(_metrics(server), "pagedlm:generation_tokens_total"))
        assert outcomes["5xx"] == 0 and outcomes["4xx"] == 0 and outcomes["503"] == 0, outcomes
        assert outcomes["ok"] >= num_streams
        assert growth < 0.05, rss
        server.assert_alive()
    finally:
        server.stop()


def test_disconnect_storm(tmp_path, tiny_model_dir, report):
    num = env_int("PAGEDLM_STRESS_DISCONNECTS", 200)
    server = _start(tmp_path, tiny_model_dir, "--max-num-seqs", "64")
    try:
        async def main() -> Counter:
            rng = random.Random(0)
            outcomes: Counter = Counter()
            sem = asyncio.Semaphore(48)

            async def one(i: int) -> None:
                async with sem, httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                    path, body = _request(rng, stream=True)
                    body.update(max_tokens=400, ignore_eos=True)
                    outcomes[await _call(client, path, body,
                                         stop_after_chunks=rng.randint(1, 20))] += 1

            await asyncio.gather(*(one(i) for i in range(num)))
            return outcomes

        outcomes = asyncio.run(main())
        _assert_idle_and_all_blocks_back(server)
        report(disconnects=outcomes["cut"], outcomes=dict(outcomes))
        assert outcomes["cut"] == num, outcomes
        server.assert_alive()
    finally:
        server.stop()


def test_queue_overflow(tmp_path, tiny_model_dir, report):
    server = _start(tmp_path, tiny_model_dir, "--max-num-seqs", "4",
                    "--max-num-queued-requests", "8")
    try:
        async def main() -> tuple[Counter, list]:
            outcomes: Counter = Counter()
            retry_after = []

            async def one(client, i: int) -> None:
                body = {"model": TINY_NAME, "prompt": PROMPTS[i % len(PROMPTS)],
                        "max_tokens": 64, "ignore_eos": True}
                r = await client.post("/v1/completions", json=body)
                if r.status_code == 503:
                    assert r.json()["error"]["code"] == "queue_full", r.text
                    retry_after.append(int(r.headers["retry-after"]))
                elif r.status_code == 200:
                    assert r.json()["usage"]["completion_tokens"] == 64
                outcomes[_status_kind(r.status_code) if r.status_code != 200 else "ok"] += 1

            limits = httpx.Limits(max_connections=200)
            async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                         limits=limits) as client:
                await asyncio.gather(*(one(client, i) for i in range(150)))
            return outcomes, retry_after

        outcomes, retry_after = asyncio.run(main())
        _assert_idle_and_all_blocks_back(server)
        report(outcomes=dict(outcomes))
        assert set(outcomes) <= {"ok", "503"}, outcomes
        assert outcomes["ok"] >= 8 and outcomes["503"] > 0, outcomes  # at least a queueful
        assert all(s >= 1 for s in retry_after)
        server.assert_alive()
    finally:
        server.stop()


def test_sigterm_drain_under_load(tmp_path, tiny_model_dir, report):
    server = _start(tmp_path, tiny_model_dir, "--max-num-seqs", "8", "--shutdown-timeout", "1")
    try:
        async def main() -> Counter:
            outcomes: Counter = Counter()

            async def one(client, i: int, started: asyncio.Event) -> None:
                body = {"model": TINY_NAME, "prompt": PROMPTS[i % len(PROMPTS)],
                        "max_tokens": 800, "ignore_eos": True, "stream": i % 2 == 0}
                if not body["stream"]:
                    started.set()
                    r = await client.post("/v1/completions", json=body)
                    kind = "ok" if r.status_code == 200 else r.json()["error"]["code"]
                    outcomes[kind] += 1
                    return
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    events = []
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[len("data: "):])
                            started.set()
                    assert events[-1] == "[DONE]", events[-2:]
                    last = json.loads(events[-2])
                    outcomes["ok" if "error" not in last else last["error"]["code"]] += 1

            limits = httpx.Limits(max_connections=100)
            async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                         limits=limits) as client:
                events = [asyncio.Event() for _ in range(32)]
                tasks = [asyncio.ensure_future(one(client, i, e)) for i, e in enumerate(events)]
                for e in events:
                    await asyncio.wait_for(e.wait(), 60)
                await asyncio.sleep(0.5)
                server.proc.send_signal(signal.SIGTERM)
                await asyncio.gather(*tasks)
            return outcomes

        outcomes = asyncio.run(main())
        code = server.proc.wait(60)
        report(outcomes=dict(outcomes), exit_status=code)
        assert sum(outcomes.values()) == 32
        assert set(outcomes) <= {"ok", "server_shutting_down"}, outcomes
        assert outcomes["server_shutting_down"] > 0, outcomes  # ~8 s of work, 1 s to finish
        assert code == 0, server.log()
    finally:
        server.stop()


def test_kill9_and_restart(tmp_path, tiny_model_dir, report):
    server = _start(tmp_path, tiny_model_dir)
    port = server.port
    try:
        children = psutil.Process(server.proc.pid).children(recursive=True)
        assert children, "no engine core process"
        r = httpx.post(f"{server.url}/v1/completions",
                       json={"model": TINY_NAME, "prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        server.proc.kill()
        server.proc.wait(30)
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"orphaned after kill -9: {[p.pid for p in alive]}"
    finally:
        server.stop()
    # The same port, at once: nothing holds it.
    restarted = ServerProcess([tiny_model_dir, "--served-model-name", TINY_NAME, *TINY_ARGS],
                              tmp_path / "restarted.log", port=port)
    try:
        t0 = time.monotonic()
        restarted.wait_healthy()
        r = httpx.post(f"{restarted.url}/v1/completions",
                       json={"model": TINY_NAME, "prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        report(orphans=0, restart_to_healthy_s=round(time.monotonic() - t0, 1))
    finally:
        restarted.stop()
