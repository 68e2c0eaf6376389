"""Every error the server answers: OpenAI's shape and status, and the server serves on."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.server.conftest import API_KEY, TINY_NAME

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def check_error(r: httpx.Response, status: int, param: str | None = "any",
                code: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param != "any":
        assert error["param"] == param, error
    if code != "any":
        assert error["code"] == code, error
    return error


def completion(**body) -> dict:
    return {"model": TINY_NAME, "prompt": "hi", "max_tokens": 2, **body}


def chat(**body) -> dict:
    return {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, **body}


@pytest.fixture(autouse=True)
def _server_survives(server):
    yield
    server.assert_alive()


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, completion(temperature=-1), "temperature"),
    (COMPLETIONS, completion(top_p=2), "top_p"),
    (COMPLETIONS, completion(presence_penalty=3), "presence_penalty"),
    (COMPLETIONS, completion(n=0), "n"),
    (COMPLETIONS, completion(n=1000), "n"),
    (COMPLETIONS, completion(max_tokens=0), "max_tokens"),
    (COMPLETIONS, completion(logprobs=21), "logprobs"),
    (COMPLETIONS, completion(min_tokens=5, max_tokens=2), "min_tokens"),
    (COMPLETIONS, completion(stop=["s"] * 17), "stop"),
    (COMPLETIONS, completion(stop="x" * 300), "stop"),
    (COMPLETIONS, completion(suffix="tail"), "suffix"),
    (COMPLETIONS, completion(logit_bias={"1": 5}), "logit_bias"),
    (COMPLETIONS, completion(prompt=[]), "prompt"),
    # Found by the fuzzer: echo decoded the ids before anything checked them (a 500).
    (COMPLETIONS, completion(prompt=[4294967296], echo=True), "prompt"),
    (COMPLETIONS, completion(prompt=[[5, -1]], echo=True), "prompt"),
    (COMPLETIONS, completion(prompt=[49152]), "prompt"),  # outside the vocabulary, named
    (COMPLETIONS, completion(unknown_field=1), "unknown_field"),
    (COMPLETIONS, completion(stream_options={"include_usage": True}), "stream_options"),
    (CHAT, chat(top_logprobs=21, logprobs=True), "top_logprobs"),
    (CHAT, chat(top_logprobs=2), "top_logprobs"),
    (CHAT, chat(messages=[]), "messages"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), "messages"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages"),
    (CHAT, chat(tools=[{"type": "function"}]), "tools"),
    (CHAT, chat(max_completion_tokens=-1), "max_completion_tokens"),
    (CHAT, chat(repetition_penalty=0), "repetition_penalty"),
    # Strict types, as OpenAI checks them: nothing is coerced.
    (COMPLETIONS, completion(max_tokens="4"), "max_tokens"),
    (COMPLETIONS, completion(stream="yes"), "stream"),
    (COMPLETIONS, completion(stream=1), "stream"),
    (COMPLETIONS, completion(prompt=[True, 5]), "prompt"),
    (COMPLETIONS, completion(prompt=[[1, False]]), "prompt"),
    (COMPLETIONS, completion(n=True), "n"),
    (COMPLETIONS, completion(temperature="0.5"), "temperature"),
    (COMPLETIONS, completion(echo="true"), "echo"),
    (CHAT, chat(max_completion_tokens=2.5), "max_completion_tokens"),  # 2.0 is an integer
    (CHAT, chat(logprobs=1), "logprobs"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), "messages"),
    (CHAT, chat(stop_token_ids=[True]), "stop_token_ids"),
    # Limits: a 64-bit seed, the vocabulary (49152 tokens here).
    (COMPLETIONS, completion(seed=2**63), "seed"),
    (COMPLETIONS, completion(seed=-(2**63) - 1), "seed"),
    (COMPLETIONS, completion(stop_token_ids=[49152]), "stop_token_ids"),
    (CHAT, chat(stop_token_ids=[0, 10**12]), "stop_token_ids"),
    (COMPLETIONS, completion(top_k=49153), "top_k"),
    (CHAT, chat(top_k=-2), "top_k"),
    (COMPLETIONS, completion(min_p=1.5), "min_p"),
    # Found by schemathesis: values that overflow float32 logits or beam scores.
    (COMPLETIONS, completion(temperature=3.5e38), "temperature"),
    (COMPLETIONS, completion(repetition_penalty=5e-324), "repetition_penalty"),
    (COMPLETIONS, completion(use_beam_search=True, length_penalty=1e308), "length_penalty"),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
])
def test_invalid_parameters_are_400(http, path, body, param):
    check_error(http.post(path, json=body), 400, param=param)


@pytest.mark.parametrize("content, content_type", [
    (b"this is not json", "application/json"),
    (b"[1, 2, 3]", "application/json"),
    (b'{"model": "tiny", "prompt": "a\x00b"}', "application/json"),
    (b"\x00\x00\x00", "application/json"),
    (b'{"model": "tiny", "prompt": 12}', "application/json"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": "many"}', "application/json"),
    (b'{"model": "tiny", "prompt": "hi", "n": 1.5}', "application/json"),
    (b'{"model": "tiny", "prompt": "hi", "stop": {"a": 1}}', "application/json"),
    (b'{"model": "tiny"', "application/json"),
    (b"\xff\xfe{}", "application/json"),
    (b"", "application/json"),
    (b'{"model": "tiny", "prompt": "hi"}', "text/plain"),
    (b'"just a string"', "application/json"),
    (b"null", "application/json"),
])
def test_malformed_bodies_are_400(http, content, content_type):
    for path in (COMPLETIONS, CHAT, "/tokenize"):
        check_error(http.post(path, content=content, headers={"Content-Type": content_type}), 400)


@pytest.mark.parametrize("body", [
    completion(seed=2**63 - 1), completion(seed=-(2**63)), completion(top_k=49152),
    completion(top_k=-1), completion(temperature=1), completion(stop_token_ids=[49151]),
])
def test_limits_are_inclusive(http, body):
    assert http.post(COMPLETIONS, json=body).status_code == 200


def test_health_head_and_declared_content_types(server, http):
    assert http.head("/health").status_code == 200
    spec = http.get("/openapi.json").json()["paths"]
    for path in ("/health", "/metrics"):
        r = http.get(path)
        assert r.status_code == 200
        declared = spec[path]["get"]["responses"]["200"]["content"]
        assert r.headers["content-type"].split(";")[0] in declared, (path, declared)
    assert http.get("/health").json() == {"status": "ok"}


def test_escaped_null_byte_is_not_a_server_error(http):
    r = http.post(COMPLETIONS, json=completion(prompt="a\u0000b"))
    assert r.status_code in (200, 400), r.text


def test_context_length_exceeded(http):
    prompt = " ".join(["word"] * 600)
    num = len(http.post("/tokenize", json={"prompt": prompt}).json()["tokens"])
    error = check_error(http.post(COMPLETIONS, json=completion(prompt=prompt, max_tokens=600)),
                        400, param="max_tokens", code="context_length_exceeded")
    assert str(num) in error["message"] and "600" in error["message"]
    assert "1024" in error["message"]
    long_prompt = " ".join(["word"] * 1100)
    check_error(http.post(COMPLETIONS, json=completion(prompt=long_prompt)), 400,
                param="prompt", code="context_length_exceeded")
    error = check_error(http.post(CHAT, json=chat(
        messages=[{"role": "user", "content": prompt}], max_completion_tokens=600)),
        400, param="max_completion_tokens", code="context_length_exceeded")
    assert "600" in error["message"]


@pytest.mark.parametrize("path, method", [
    ("/v1/models", "GET"), ("/metrics", "GET"), ("/version", "GET"), ("/tokenize", "POST"),
    (COMPLETIONS, "POST"), (CHAT, "POST"), ("/openapi.json", "GET"),
])
def test_api_key_required(server, path, method):
    body = None
    if method == "POST":
        body = {"/tokenize": {"prompt": "hi"}, CHAT: chat()}.get(path, completion())
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Basic {API_KEY}"}):
        r = httpx.request(method, server.url + path, json=body, headers=headers)
        check_error(r, 401, code="invalid_api_key")
    r = httpx.request(method, server.url + path, json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text


def test_unknown_model_is_404(http):
    check_error(http.post(COMPLETIONS, json=completion(model="gpt-4")), 404, param="model",
                code="model_not_found")
    check_error(http.post(CHAT, json=chat(model="gpt-4")), 404, param="model")
    check_error(http.get("/v1/models/gpt-4"), 404, param="model")
    check_error(http.get("/no/such/path"), 404)
    check_error(http.delete("/v1/models"), 405)


def test_oversized_body_is_413(http):
    big = completion(prompt="x" * 300_000)  # the test server's limit is 256 KiB
    check_error(http.post(COMPLETIONS, json=big), 413, code="request_too_large")

    def chunks():  # no Content-Length: the limit must hold for a streamed upload too
        for _ in range(40):
            yield b"x" * 10_000

    check_error(http.post(COMPLETIONS, content=chunks(),
                          headers={"Content-Type": "application/json"}), 413)


def test_full_queue_is_503_with_retry_after(busy_server):
    body = {**completion(max_tokens=200), "ignore_eos": True}

    def post(_):
        return httpx.post(f"{busy_server.url}{COMPLETIONS}", json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(post, range(8)))
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses and 503 in statuses, statuses
    assert set(statuses) <= {200, 503}
    for r in responses:
        if r.status_code == 503:
            check_error(r, 503, code="queue_full")
            assert r.headers["Retry-After"] == "1"
    busy_server.assert_alive()
    assert httpx.post(f"{busy_server.url}{COMPLETIONS}", json=completion()).status_code == 200


def test_a_request_larger_than_the_queue_is_400(busy_server):
    """The busy server queues one sequence: n x prompts above that can never fit."""
    url = f"{busy_server.url}{COMPLETIONS}"
    error = check_error(httpx.post(url, json=completion(n=2)), 400, param="n")
    assert "queues at most 1 (--max-num-queued-requests)" in error["message"]
    check_error(httpx.post(url, json=completion(prompt=["a", "b"])), 400, param="n")
    check_error(httpx.post(f"{busy_server.url}{CHAT}", json=chat(n=3)), 400, param="n")


def test_default_max_tokens_is_capped(busy_server):
    """Without max_tokens, a reply gets --max-tokens-default tokens (7 on the busy
    server), or what the context leaves if that is less; never a whole context."""
    def usage(path, body):
        r = httpx.post(f"{busy_server.url}{path}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    body = chat(ignore_eos=True)
    del body["max_tokens"]
    assert usage(CHAT, body)["completion_tokens"] == 7
    assert usage(COMPLETIONS, completion(max_tokens=None, ignore_eos=True))[
        "completion_tokens"] == 7
    assert usage(COMPLETIONS, completion(ignore_eos=True, max_tokens=12))[
        "completion_tokens"] == 12  # an explicit value is not capped
    long_prompt = [5] * 1020  # max_model_len 1024 leaves 4
    assert usage(COMPLETIONS, completion(prompt=long_prompt, max_tokens=None, ignore_eos=True))[
        "completion_tokens"] == 4
