"""The conftest hook really checks what the server tests read: plain httpx, the `openai`
client (sync and async), streams and error bodies all pass through it."""

from __future__ import annotations

import asyncio

import pytest

from tests.server import openai_schema
from tests.server.conftest import TINY_NAME


@pytest.fixture
def seen(monkeypatch):
    calls: list[tuple[str, int, str]] = []
    check = openai_schema.check_server_response

    def record(path, status, content_type, body):
        calls.append((path, status, content_type.split(";")[0]))
        check(path, status, content_type, body)

    monkeypatch.setattr(openai_schema, "check_server_response", record)
    return calls


def test_every_kind_of_response_is_checked(seen, http, client, async_client_factory):
    messages = [{"role": "user", "content": "Hi"}]
    http.post("/v1/completions", json={"model": TINY_NAME, "prompt": "Hi", "max_tokens": 2})
    http.post("/v1/completions", json={"model": TINY_NAME, "prompt": "Hi", "max_tokens": 0})
    list(client.chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=2,
                                        stream=True))
    client.models.list()

    async def chat() -> None:
        async with async_client_factory() as aclient:
            await aclient.chat.completions.create(model=TINY_NAME, messages=messages,
                                                  max_tokens=2)

    asyncio.run(chat())
    assert seen == [("/v1/completions", 200, "application/json"),
                    ("/v1/completions", 400, "application/json"),
                    ("/v1/chat/completions", 200, "text/event-stream"),
                    ("/v1/models", 200, "application/json"),
                    ("/v1/chat/completions", 200, "application/json")]


def test_a_violation_fails_the_test():
    body = b'{"id": "x", "object": "chat.completion", "created": 1, "model": "m", ' \
           b'"choices": [{"index": 0, "finish_reason": "stop", "logprobs": null, ' \
           b'"message": {"role": "assistant", "content": "hi"}}]}'
    with pytest.raises(AssertionError, match="refusal"):
        openai_schema.check_server_response("/v1/chat/completions", 200, "application/json",
                                            body)
    with pytest.raises(AssertionError, match="message"):
        openai_schema.check_server_response("/v1/completions", 400, "application/json",
                                            b'{"error": {"type": "x", "param": null, '
                                            b'"code": null}}')
