"""`pagedlm serve --tensor-parallel-size 2` end to end: the same answers as one rank, with
streaming, n > 1, prefix caching and metrics; a rank killed mid-stream fails the stream
with an error, turns /health to 503, and stopping the server leaves no process behind."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from pagedlm.entrypoints.openai.metrics import PREFIX
from tests.server.conftest import API_KEY, TINY_ARGS, TINY_NAME, _start, metric_value


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory, tiny_model_dir):
    yield from _start(tmp_path_factory, "tp2", [
        tiny_model_dir, *TINY_ARGS, "--served-model-name", TINY_NAME,
        "--tensor-parallel-size", "2",
    ], api_key=API_KEY)


def _chat(url: str, **body) -> httpx.Response:
    body = {"model": TINY_NAME, "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 16, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"})


def test_two_ranks_answer_as_one(server, tp_server):
    one, two = _chat(server.url), _chat(tp_server.url)
    assert one.status_code == two.status_code == 200
    assert two.json()["choices"][0]["message"] == one.json()["choices"][0]["message"]
    sampled = dict(n=3, temperature=1.0, seed=5)
    a, b = _chat(server.url, **sampled).json(), _chat(tp_server.url, **sampled).json()
    assert [c["message"]["content"] for c in a["choices"]] == \
        [c["message"]["content"] for c in b["choices"]]
    again = _chat(tp_server.url)  # the same prompt: its blocks come from the prefix cache
    assert again.json()["choices"][0]["message"] == one.json()["choices"][0]["message"]
    time.sleep(0.5)  # the engine publishes its statistics every 0.2 s
    metrics = httpx.get(f"{tp_server.url}/metrics", headers=tp_server.headers, timeout=10).text
    assert metric_value(metrics, PREFIX + "generation_tokens_total") > 0
    assert metric_value(metrics, PREFIX + "prefix_cache_hits_total") > 0


def test_killed_rank_fails_the_stream_and_health(tp_server):
    server_proc = psutil.Process(tp_server.proc.pid)
    ranks = [p for p in server_proc.children(recursive=True)
             if "pagedlm.executor.worker_proc" in " ".join(p.cmdline())]
    assert len(ranks) == 2
    body = {"model": TINY_NAME, "prompt": "Once upon a time", "max_tokens": 1000,
            "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", f"{tp_server.url}/v1/completions", json=body, timeout=60,
                      headers=tp_server.headers) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    os.kill(ranks[1].pid, signal.SIGKILL)
    assert events[-1] == "[DONE]"
    assert any('"error"' in e for e in events[3:]), events[-3:]
    deadline = time.monotonic() + 10
    while httpx.get(f"{tp_server.url}/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert _chat(tp_server.url).status_code >= 500
    gone = psutil.wait_procs(ranks, timeout=10)[1]
    assert not gone, "a rank outlived the failure"
    tp_server.stop()
    assert not server_proc.is_running() or server_proc.status() == psutil.STATUS_ZOMBIE
