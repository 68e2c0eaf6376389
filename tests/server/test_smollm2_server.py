"""`pagedlm serve` on the real embedded model: a sensible answer, and /health stays prompt
while a long prefill occupies the engine."""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import requires_smollm2
from tests.server.conftest import ServerProcess, _start

pytestmark = [requires_smollm2, pytest.mark.slow]


@pytest.fixture(scope="module")
def smol_server(tmp_path_factory) -> Iterator[ServerProcess]:
    yield from _start(tmp_path_factory, "smollm2", [
        "--kv-cache-memory", "256M", "--max-num-batched-tokens", "2048",
        "--uvicorn-log-level", "warning"])


def test_smollm2_chat_and_health_during_prefill(smol_server):
    import openai

    client = openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="unused", max_retries=0)
    assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_completion_tokens=24,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content

    # A ~600-token prompt: one prefill step of seconds on a laptop CPU. Poll /health
    # all the while.
    prompt = "The quick brown fox jumps over the lazy dog. " * 60
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=smol_server.url, timeout=10) as http:
            while not done.is_set():
                t0 = time.perf_counter()
                assert http.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    t0 = time.perf_counter()
    try:
        r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=1)
    finally:
        done.set()
        poller.join()
    prefill_s = time.perf_counter() - t0
    assert r.usage.prompt_tokens > 500
    print(f"\nprefill of {r.usage.prompt_tokens} tokens: {prefill_s:.2f} s; /health during it: "
          f"{len(latencies)} polls, median {statistics.median(latencies) * 1000:.1f} ms, "
          f"max {max(latencies) * 1000:.1f} ms")
    # /health kept answering while the prefill ran (the latencies are printed above: a
    # figure, not an assertion).
    assert len(latencies) >= 3


def _readme_block(language: str, marker: str) -> str:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = re.findall(rf"```{language}\n(.*?)```", readme, flags=re.S)
    return next(b for b in blocks if marker in b)


def test_readme_curl_and_openai_examples_work_as_written(smol_server):
    """The README's main job: `pagedlm serve`, then its curl and openai examples."""
    port = f"127.0.0.1:{smol_server.port}"
    curl = _readme_block("bash", "curl ").replace("127.0.0.1:8000", port)
    if shutil.which("curl") is not None:
        proc = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        reply = json.loads(proc.stdout)
        assert "Paris" in reply["choices"][0]["message"]["content"], reply
    script = _readme_block("python", "from openai import OpenAI").replace("127.0.0.1:8000", port)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip()) > 10, proc.stdout


def test_smollm2_structured_outputs_through_the_openai_client(smol_server):
    """The embedded model, a Pydantic response_format through the client's .parse(), and
    json_object: real answers that parse."""
    import openai
    from pydantic import BaseModel

    class City(BaseModel):
        city: str
        country: str

    client = openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Which city is the capital of France? Answer "
                                            "with the city and its country."}]
    parsed = client.chat.completions.parse(
        model="SmolLM2-135M-Instruct", messages=messages, temperature=0,
        max_completion_tokens=60, response_format=City)
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, City)
    assert "Paris" in choice.message.parsed.city, choice.message.parsed

    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, temperature=0,
        max_completion_tokens=80, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
