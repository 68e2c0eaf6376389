"""`pagedlm serve --speculative-config`: several tokens per step reach the client as the
same text, streamed or not, with stop strings cutting inside an accepted run of drafts;
usage counts and the spec_decode metrics."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import requires_smollm2, smollm2_path
from tests.server.conftest import ServerProcess, _start, metric_value

pytestmark = [requires_smollm2, pytest.mark.slow]

NAME = "SmolLM2-135M-Instruct"
# Answers that repeat their prompt: drafts from it are often right.
PROMPTS = [
    "Copy this list exactly, twice:\n- apples, pears, plums\n- bread, butter, jam\n"
    "- tea, coffee, milk\n",
    "Rewrite this sentence with every word in capitals: the quick brown fox jumps over the "
    "lazy dog, and the quick brown fox jumps again.",
]


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory) -> Iterator[ServerProcess]:
    yield from _start(tmp_path_factory, "spec", [
        "--kv-cache-memory", "128M", "--uvicorn-log-level", "warning",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])


@pytest.fixture(scope="module")
def plain_texts() -> list[str]:
    """What the engine answers without speculation (in this process)."""
    from pagedlm import LLM, SamplingParams

    llm = LLM(smollm2_path(), kv_cache_memory=128 << 20)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    outs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def _chat(server: ServerProcess, prompt: str, **extra) -> httpx.Response:
    body = {"model": NAME, "messages": [{"role": "user", "content": prompt}],
            "temperature": 0, "max_tokens": 64, **extra}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def _stream_text(server: ServerProcess, prompt: str, **extra) -> tuple[str, dict | None]:
    import json

    text, usage = [], None
    body = {"model": NAME, "messages": [{"role": "user", "content": prompt}],
            "temperature": 0, "max_tokens": 64, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                text.append(choice["delta"].get("content") or "")
    return "".join(text), usage


def test_same_text_streamed_or_not(spec_server, plain_texts):
    for prompt, expected in zip(PROMPTS, plain_texts):
        r = _chat(spec_server, prompt)
        assert r.status_code == 200, r.text
        reply = r.json()
        assert reply["choices"][0]["message"]["content"] == expected
        streamed, usage = _stream_text(spec_server, prompt)
        assert streamed == expected
        assert usage["completion_tokens"] == reply["usage"]["completion_tokens"]
    metrics = httpx.get(f"{spec_server.url}/metrics", timeout=30).text
    accepted = metric_value(metrics, "pagedlm:spec_decode_num_accepted_tokens_total")
    drafted = metric_value(metrics, "pagedlm:spec_decode_num_draft_tokens_total")
    assert 0 < accepted <= drafted
    # The dashboard's snapshot and `pagedlm top` report it too.
    stats = httpx.get(f"{spec_server.url}/dashboard/state", timeout=30).json()["snapshot"]["stats"]
    assert stats["spec_num_accepted_tokens"] == accepted
    assert stats["spec_acceptance_rate"] == pytest.approx(accepted / drafted)
    top = subprocess.run([sys.executable, "-m", "pagedlm.entrypoints.cli", "top", spec_server.url,
                          "--once"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "160"})
    assert top.returncode == 0 and "drafts accepted" in top.stdout, top.stdout + top.stderr


def test_stop_string_inside_accepted_drafts(spec_server, plain_texts):
    """A stop string in the middle of the answer (tokens arrive several per step here):
    the text stops before it, as without speculation, and nothing after it leaks into the
    stream."""
    expected = plain_texts[0]
    words = expected.split()
    stop = " ".join(words[len(words) // 2:len(words) // 2 + 2])
    cut = expected[:expected.index(stop)]
    r = _chat(spec_server, PROMPTS[0], stop=[stop])
    assert r.json()["choices"][0]["message"]["content"] == cut
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    streamed, _ = _stream_text(spec_server, PROMPTS[0], stop=[stop])
    assert streamed == cut
