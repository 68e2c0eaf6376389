"""Fault isolation: a fault confined to one request fails that request alone (HTTP 500
with a clear message, or an error event then [DONE] on a stream) while the batch goes on
and every KV block comes back; a fault the engine cannot attribute fails every request in
flight and turns /health to 503.

Faults are injected with monkeypatch into a server running in this process (the app of
`pagedlm serve` on uvicorn, its engine core on a thread), so no test hook ships in the
package. The core-process path of an engine-wide fault (exit status 1) is tested in
test_core_process.py.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import torch

from pagedlm.config import EngineArgs
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.detokenizer import IncrementalDetokenizer
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.entrypoints.openai.api_server import build_app
from pagedlm.sample.sampler import Sampler
from tests.server.conftest import HOST, TINY_NAME, free_port

MARKER_TOKEN = 4242  # a prompt holding it has a broken detokenizer
SAMPLER_FAULT_T = 0.666  # a request at this temperature breaks the sampler
NAN_T = 0.777  # a request at this temperature gets NaN logits


@contextmanager
def serve_in_process(model_dir: str) -> Iterator[tuple[str, LLMEngine, AsyncLLMEngine]]:
    import uvicorn

    llm_engine = LLMEngine(EngineArgs(model=model_dir, kv_cache_memory=16 << 20,
                                      max_model_len=512, seed=0))
    engine = AsyncLLMEngine(llm_engine, max_num_queued_requests=64)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, [TINY_NAME]), host=HOST, port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://{HOST}:{port}", llm_engine, engine
    finally:
        server.should_exit = True
        thread.join(60)


@pytest.fixture
def served(tiny_model_dir):
    with serve_in_process(tiny_model_dir) as served:
        yield served


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def _stream_events(url: str, body: dict) -> list[str] | httpx.Response:
    """The events of a stream, or the response if the request failed before streaming."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        if r.status_code != 200:
            r.read()
            return r
        return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


def _stream_error(events: list[str] | httpx.Response) -> dict:
    """The error a stream ended with: an error event then [DONE], or (a failure before
    the first byte) an error response."""
    if isinstance(events, httpx.Response):
        return events.json()["error"]
    assert events[-1] == "[DONE]", events[-3:]
    return json.loads(events[-2])["error"]


def _normal(i: int) -> dict:
    return {"model": TINY_NAME, "prompt": f"Story number {i}:", "max_tokens": 40,
            "ignore_eos": True, "temperature": 1.0, "seed": i}


def _run_with_others(url: str, faulty: dict) -> tuple[httpx.Response, list[str],
                                                       list[httpx.Response]]:
    """The faulty request (whole and streamed) while four normal ones run with it."""
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        others = [pool.submit(_post, url, _normal(i)) for i in range(4)]
        whole = pool.submit(_post, url, faulty)
        streamed = pool.submit(_stream_events, url, faulty)
        return whole.result(), streamed.result(), [f.result() for f in others]


def _assert_failed_alone(url: str, engine: AsyncLLMEngine, faulty: dict, words: str) -> None:
    whole, events, others = _run_with_others(url, faulty)
    assert whole.status_code == 500, whole.text
    error = whole.json()["error"]
    assert error["code"] == "internal_error" and words in error["message"], error
    error = _stream_error(events)
    assert error["code"] == "internal_error" and words in error["message"], error
    for r in others:  # the batch went on
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 40
    _assert_all_blocks_back(engine)
    assert _post(url, _normal(9)).status_code == 200  # and it still serves


def _assert_all_blocks_back(engine: AsyncLLMEngine) -> None:
    deadline = time.monotonic() + 30
    while True:
        stats = engine.stats
        if (stats.num_blocks_free == stats.num_blocks_total and stats.num_requests_running == 0
                and stats.num_requests_waiting == 0):
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def test_tokenizer_fault_fails_one_request(served, monkeypatch):
    url, _, engine = served
    tokenizer_type = type(engine.tokenizer)
    original = tokenizer_type.__call__

    def call(self, text, *args, **kwargs):
        if isinstance(text, str) and "TOKENIZER-FAULT" in text:
            raise RuntimeError("injected tokenizer fault")
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(tokenizer_type, "__call__", call)
    _assert_failed_alone(url, engine, {**_normal(0), "prompt": "a TOKENIZER-FAULT b"},
                         "RuntimeError")


def test_detokenizer_fault_fails_one_request(served, monkeypatch):
    url, _, engine = served
    original_init, original_update = IncrementalDetokenizer.__init__, IncrementalDetokenizer.update

    def init(self, tokenizer, prompt_token_ids, **kwargs):
        original_init(self, tokenizer, prompt_token_ids, **kwargs)
        self.injected_fault = MARKER_TOKEN in prompt_token_ids

    def update(self, new_token_ids):
        if getattr(self, "injected_fault", False):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return original_update(self, new_token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "__init__", init)
    monkeypatch.setattr(IncrementalDetokenizer, "update", update)
    _assert_failed_alone(url, engine, {**_normal(0), "prompt": [1, MARKER_TOKEN, 7, 9]},
                         "processing this request's output failed (UnicodeDecodeError")


def test_sampler_fault_fails_one_request(served, monkeypatch):
    url, _, engine = served
    original = Sampler.__call__

    def call(self, logits, batch):
        if batch.temperature is not None and bool(
                ((batch.temperature - SAMPLER_FAULT_T).abs() < 1e-4).any()):
            raise IndexError("injected kernel fault")
        return original(self, logits, batch)

    monkeypatch.setattr(Sampler, "__call__", call)
    _assert_failed_alone(url, engine, {**_normal(0), "temperature": SAMPLER_FAULT_T},
                         "sampling failed for this request (IndexError: injected kernel fault)")


def test_nan_logits_fail_one_request(served, monkeypatch):
    url, llm_engine, engine = served
    runner = llm_engine.model_executor.driver_worker.model_runner
    original_prepare, original_logits = runner.prepare_inputs, runner.model.compute_logits
    step: dict = {}

    def prepare_inputs(sched):
        step["inputs"] = original_prepare(sched)
        return step["inputs"]

    def compute_logits(hidden):
        logits = original_logits(hidden)
        temperature = runner.input_batch.temperature[step["inputs"].sampled_rows]
        rows = torch.from_numpy(abs(temperature - NAN_T) < 1e-4)
        if bool(rows.any()):
            logits = logits.clone()
            logits[rows, 123] = float("nan")
        return logits

    monkeypatch.setattr(runner, "prepare_inputs", prepare_inputs)
    monkeypatch.setattr(runner.model, "compute_logits", compute_logits)
    _assert_failed_alone(url, engine, {**_normal(0), "temperature": NAN_T, "n": 2},
                         "non-finite logits")


def test_an_engine_fault_fails_everything_and_health(served, monkeypatch, caplog):
    url, llm_engine, engine = served
    runner = llm_engine.model_executor.driver_worker.model_runner
    original_forward = runner._forward
    calls = {"n": 0}

    def forward(inputs):
        calls["n"] += 1
        if calls["n"] > 5:
            raise RuntimeError("injected forward fault")
        return original_forward(inputs)

    monkeypatch.setattr(runner, "_forward", forward)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_post, url, {**_normal(i), "max_tokens": 200}) for i in range(3)]
        streamed = pool.submit(_stream_events, url, {**_normal(5), "max_tokens": 200})
        responses = [f.result() for f in futures]
        events = streamed.result()
    for r in responses:
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        message = r.json()["error"]["message"]
        assert "injected forward fault" in message
        assert "Traceback" not in message and 'File "' not in message  # in the log only
    assert _stream_error(events)["code"] == "engine_dead"
    health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    assert not engine.is_healthy
    assert any("injected forward fault" in (r.exc_text or "") for r in caplog.records), \
        "the traceback was not logged"
