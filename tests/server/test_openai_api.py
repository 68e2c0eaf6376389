"""The OpenAI-compatible endpoints, through the official `openai` client, on a tiny model."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import TINY_NAME, metric_value

GREEDY = {"temperature": 0.0}


def _tokens(http: httpx.Client, **body) -> list[int]:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_models_version_health(client, http, server):
    ids = [m.id for m in client.models.list().data]
    assert ids == [TINY_NAME, "alias"]
    assert client.models.retrieve("alias").id == "alias"
    assert http.get("/version").json()["version"]
    # /health needs no key; everything else does (see test_errors).
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_completion_usage_and_prompt_forms(client, http):
    r = client.completions.create(model=TINY_NAME, prompt="The capital of France is",
                                  max_tokens=8, **GREEDY)
    ids = _tokens(http, prompt="The capital of France is")
    assert r.object == "text_completion" and r.model == TINY_NAME
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == len(ids) + 8
    # The same prompt as token ids gives the same greedy text; the alias name works too.
    by_ids = client.completions.create(model="alias", prompt=ids, max_tokens=8, **GREEDY)
    assert by_ids.choices[0].text == r.choices[0].text
    # A list of prompts with n=2: choices numbered prompt * n + sample.
    many = client.completions.create(model=TINY_NAME, prompt=["One", "Two"], n=2, max_tokens=4,
                                     **GREEDY)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text  # greedy samples agree
    nested = client.completions.create(model=TINY_NAME, prompt=[ids, ids[:2]], max_tokens=8,
                                       **GREEDY)
    assert nested.choices[0].text == r.choices[0].text
    assert len(nested.choices) == 2


def test_echo_and_logprobs(client):
    prompt = "Paged attention"
    r = client.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=5, logprobs=3,
                                  **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(x <= 0 for x in lp.token_logprobs)
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[token] == pytest.approx(chosen)
        # Greedy picks the most likely token.
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)
    echoed = client.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=5, logprobs=2,
                                       echo=True, **GREEDY)
    choice = echoed.choices[0]
    assert choice.text == prompt + r.choices[0].text
    assert choice.logprobs.token_logprobs[0] is None  # the first prompt token has none
    assert len(choice.logprobs.tokens) == r.usage.prompt_tokens + 5


def test_chat_multi_turn_and_logprobs(client, http):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
    ]
    r = client.chat.completions.create(model=TINY_NAME, messages=messages,
                                       max_completion_tokens=6, logprobs=True, top_logprobs=2,
                                       **GREEDY)
    assert r.object == "chat.completion"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(_tokens(http, messages=messages))
    assert r.usage.completion_tokens == 6
    content = choice.logprobs.content
    assert len(content) == 6
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)
    # The deprecated max_tokens still works.
    old = client.chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=6,
                                         **GREEDY)
    assert old.choices[0].message.content == choice.message.content


def test_streaming_equals_non_streaming(client):
    kwargs = dict(model=TINY_NAME, max_tokens=24, **GREEDY)
    whole = client.completions.create(prompt="Once upon a time", **kwargs)
    chunks = list(client.completions.create(prompt="Once upon a time", stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    reasons = [c.choices[0].finish_reason for c in text_chunks]
    assert reasons[-1] == "length" and not any(reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens

    messages = [{"role": "user", "content": "Tell me a story."}]
    whole_chat = client.chat.completions.create(messages=messages, **kwargs)
    chat_chunks = list(client.chat.completions.create(
        messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices)
    assert streamed == whole_chat.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chat_chunks if c.choices]
    assert finals[-1] == "length" and not any(finals[:-1])
    assert chat_chunks[-1].usage.completion_tokens == 24


def test_streaming_n_choices(client):
    chunks = list(client.chat.completions.create(
        model=TINY_NAME, messages=[{"role": "user", "content": "Hi"}], n=3, max_tokens=5,
        temperature=1.0, seed=3, stream=True))
    texts = {i: "" for i in range(3)}
    finished = set()
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                assert c.index not in finished
                finished.add(c.index)
    assert finished == {0, 1, 2}
    whole = client.chat.completions.create(
        model=TINY_NAME, messages=[{"role": "user", "content": "Hi"}], n=3, max_tokens=5,
        temperature=1.0, seed=3)
    assert [c.message.content for c in whole.choices] == [texts[i] for i in range(3)]


def test_seeds_reproducible(client):
    kwargs = dict(model=TINY_NAME, prompt="Random words:", max_tokens=12, temperature=1.0, n=2)
    a = client.completions.create(seed=7, **kwargs)
    b = client.completions.create(seed=7, **kwargs)
    c = client.completions.create(seed=8, **kwargs)
    texts = lambda r: [ch.text for ch in r.choices]  # noqa: E731
    assert texts(a) == texts(b)
    assert texts(a) != texts(c)
    assert texts(a)[0] != texts(a)[1]  # the n samples differ


def test_stop_strings(client):
    kwargs = dict(model=TINY_NAME, prompt="Count:", max_tokens=32, **GREEDY)
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[10:13]
    assert len(stop) == 3, full
    cut = full.index(stop)
    r = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert r.text == full[:cut] and r.finish_reason == "stop"
    kept = client.completions.create(stop=stop, extra_body={"include_stop_str_in_output": True},
                                     **kwargs).choices[0]
    assert kept.text == full[:cut + len(stop)]
    streamed = client.completions.create(stop=[stop], stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in streamed) == full[:cut]


def test_vllm_extra_sampling_fields(client):
    extra = {"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 10,
             "ignore_eos": True, "stop_token_ids": [2], "skip_special_tokens": False,
             "include_stop_str_in_output": False, "spaces_between_special_tokens": True}
    r = client.completions.create(model=TINY_NAME, prompt="x", max_tokens=10, seed=1,
                                  temperature=0.7, extra_body=extra)
    assert r.usage.completion_tokens == 10
    chat = client.chat.completions.create(model=TINY_NAME, messages=[{"role": "user",
                                                                      "content": "x"}],
                                          max_completion_tokens=10, extra_body=extra)
    assert chat.usage.completion_tokens == 10


def test_tokenize_detokenize(http):
    tokens = _tokens(http, prompt="Hello world", add_special_tokens=False)
    assert tokens
    r = http.post("/detokenize", json={"tokens": tokens})
    assert r.json() == {"prompt": "Hello world"}
    counted = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert counted["count"] == len(counted["tokens"]) and counted["max_model_len"] == 1024


def test_metrics(client, http):
    client.completions.create(model=TINY_NAME, prompt="metrics", max_tokens=3, **GREEDY)
    text = http.get("/metrics").text
    for name in ("pagedlm:num_requests_running", "pagedlm:num_requests_waiting",
                 "pagedlm:kv_cache_usage_perc", "pagedlm:num_preemptions_total",
                 "pagedlm:prompt_tokens_total", "pagedlm:generation_tokens_total",
                 "pagedlm:time_to_first_token_seconds_bucket",
                 "pagedlm:inter_token_latency_seconds_count",
                 "pagedlm:e2e_request_latency_seconds_sum",
                 "pagedlm:request_queue_time_seconds_count", "pagedlm:request_success_total"):
        assert name in text, name
    assert metric_value(text, "pagedlm:prompt_tokens_total") > 0
    assert metric_value(text, "pagedlm:generation_tokens_total") >= 3
    assert metric_value(text, "pagedlm:request_success_total", {"finished_reason": "length"}) >= 1
    assert metric_value(text, "pagedlm:time_to_first_token_seconds_count") >= 1
    assert 0.0 <= metric_value(text, "pagedlm:kv_cache_usage_perc") <= 1.0
    # Block sharing: the same prompt twice hits the prefix cache.
    for _ in range(2):
        client.completions.create(model=TINY_NAME, prompt="shared prefix " * 12, max_tokens=1, **GREEDY)
    text = http.get("/metrics").text
    assert metric_value(text, "pagedlm:prefix_cache_hits_total") >= 16  # one full block
    assert metric_value(text, "pagedlm:prefix_cache_queries_total") >= metric_value(
        text, "pagedlm:prefix_cache_hits_total")
    for name in ("pagedlm:kv_blocks_shared", "pagedlm:kv_tokens_held", "pagedlm:kv_tokens_held_unshared",
                 "pagedlm:kv_block_copies_total"):
        assert name in text, name


def test_cors_is_off_by_default(server):
    r = httpx.options(f"{server.url}/v1/models", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in r.headers


def test_cors_when_allowed(busy_server):
    preflight = {"Access-Control-Request-Method": "POST"}
    r = httpx.options(f"{busy_server.url}/v1/completions",
                      headers={"Origin": "http://ok.example", **preflight})
    assert r.headers.get("access-control-allow-origin") == "http://ok.example"
    r = httpx.options(f"{busy_server.url}/v1/completions",
                      headers={"Origin": "http://evil.example", **preflight})
    assert "access-control-allow-origin" not in r.headers


def test_beam_search_through_the_server(client, tiny_model_dir):
    """`use_beam_search` with `n` (vLLM's extra parameter): the n best beams, best first,
    equal to the offline LLM.beam_search on the same model."""
    from pagedlm import LLM, BeamSearchParams

    prompt = "The capital of France is"
    r = client.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=6, n=2,
                                  extra_body={"use_beam_search": True, "best_of": 3,
                                              "ignore_eos": True, "length_penalty": 1.0})
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(texts) == 2 and r.usage.completion_tokens == 12
    llm = LLM(tiny_model_dir, kv_cache_memory=32 << 20, max_model_len=1024)
    ref = llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))[0]
    tok = llm.get_tokenizer()
    assert texts == [tok.decode(s.generated_token_ids, skip_special_tokens=True) for s in ref.sequences[:2]]
