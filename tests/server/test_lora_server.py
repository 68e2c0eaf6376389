"""`pagedlm serve --enable-lora`: adapters as model names. A request's `model` picks its
adapter (the same tokens as the offline engine with that adapter), `/v1/models` lists
adapters with the base as parent, adapters are loaded and unloaded while serving behind
the API key, and unknown names are 404s in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import (
    API_KEY,
    TINY_ARGS,
    TINY_NAME,
    ServerProcess,
    _start,
    metric_value,
)

PROMPT = "The quick brown fox"
MAX_TOKENS = 10


def _adapter(tmp_path_factory, model_dir: str, seed: int, rank: int) -> str:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(LlamaForCausalLM.from_pretrained(model_dir), LoraConfig(
        r=rank, lora_alpha=2 * rank, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]))
    # Random B at PEFT's init scale barely moves a tiny model: make the adapter matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(20)
    path = tmp_path_factory.mktemp(f"adapter-{seed}")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir) -> dict[str, str]:
    return {"ad1": _adapter(tmp_path_factory, tiny_model_dir, 1, 8),
            "ad2": _adapter(tmp_path_factory, tiny_model_dir, 2, 4)}


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, tiny_model_dir, adapters) -> Iterator[ServerProcess]:
    # One slot: requests of the two adapters take turns in it.
    yield from _start(tmp_path_factory, "lora", [
        tiny_model_dir, *TINY_ARGS, "--served-model-name", TINY_NAME, "--enable-lora",
        "--max-loras", "1", "--max-lora-rank", "8", "--lora-modules", f"ad1={adapters['ad1']}",
    ], api_key=API_KEY)


@pytest.fixture(scope="module")
def offline_texts(tiny_model_dir, adapters) -> dict[str | None, str]:
    """Greedy completions of PROMPT in this process: base and each adapter."""
    from pagedlm import LLM, LoRARequest, SamplingParams

    llm = LLM(tiny_model_dir, enable_lora=True, max_loras=2, max_lora_rank=8,
              kv_cache_memory=32 << 20, max_model_len=1024)
    loras = [None, LoRARequest("ad1", 1, adapters["ad1"]), LoRARequest("ad2", 2, adapters["ad2"])]
    outs = llm.generate([PROMPT] * 3, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                     ignore_eos=True),
                        use_tqdm=False, lora_request=loras)
    texts = {None: outs[0].outputs[0].text, "ad1": outs[1].outputs[0].text,
             "ad2": outs[2].outputs[0].text}
    assert len(set(texts.values())) == 3, texts  # each adapter changes the output
    return texts


def _client(server: ServerProcess, key: str | None = API_KEY) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=120)


def _complete(http: httpx.Client, model: str) -> httpx.Response:
    return http.post("/v1/completions", json={
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True})


def test_models_lists_adapters_with_their_base(lora_server):
    with _client(lora_server) as http:
        cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
        assert set(cards) == {TINY_NAME, "ad1"}
        assert cards["ad1"]["parent"] == TINY_NAME
        assert cards[TINY_NAME].get("parent") is None
        one = http.get("/v1/models/ad1")
        assert one.status_code == 200 and one.json()["parent"] == TINY_NAME


def test_model_field_picks_the_adapter(lora_server, offline_texts):
    with _client(lora_server) as http:
        for model, key in ((TINY_NAME, None), ("ad1", "ad1")):
            r = _complete(http, model)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
            assert r.json()["choices"][0]["text"] == offline_texts[key]
        chat = http.post("/v1/chat/completions", json={
            "model": "ad1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert chat.status_code == 200 and chat.json()["model"] == "ad1"


def test_unknown_model_is_404(lora_server):
    with _client(lora_server) as http:
        r = _complete(http, "no-such-adapter")
        assert r.status_code == 404
        error = r.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "ad1" in error["message"]  # the names that exist


def test_load_use_and_unload_an_adapter(lora_server, adapters, offline_texts, tmp_path):
    with _client(lora_server) as http:
        # Behind the API key.
        with _client(lora_server, key=None) as anonymous:
            r = anonymous.post("/v1/load_lora_adapter",
                               json={"lora_name": "ad2", "lora_path": adapters["ad2"]})
            assert r.status_code == 401
        bad = http.post("/v1/load_lora_adapter",
                        json={"lora_name": "broken", "lora_path": str(tmp_path / "missing")})
        assert bad.status_code == 400 and "no such directory" in bad.json()["error"]["message"]
        (tmp_path / "pickled").mkdir()
        (tmp_path / "pickled" / "adapter_config.json").write_text('{"r": 8}')
        (tmp_path / "pickled" / "adapter_model.bin").write_bytes(b"not really")
        bad = http.post("/v1/load_lora_adapter",
                        json={"lora_name": "pickled", "lora_path": str(tmp_path / "pickled")})
        assert bad.status_code == 400 and "pickle" in bad.json()["error"]["message"]
        clash = http.post("/v1/load_lora_adapter",
                          json={"lora_name": TINY_NAME, "lora_path": adapters["ad2"]})
        assert clash.status_code == 400

        r = http.post("/v1/load_lora_adapter",
                      json={"lora_name": "ad2", "lora_path": adapters["ad2"]})
        assert r.status_code == 200, r.text
        again = http.post("/v1/load_lora_adapter",
                          json={"lora_name": "ad2", "lora_path": adapters["ad2"]})
        assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
        assert "ad2" in {c["id"] for c in http.get("/v1/models").json()["data"]}
        r = _complete(http, "ad2")
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline_texts["ad2"]

        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "ad2"}).status_code == 200
        assert _complete(http, "ad2").status_code == 404
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "ad2"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert "ad2" not in {c["id"] for c in http.get("/v1/models").json()["data"]}


def test_concurrent_requests_of_two_adapters_and_the_base_share_one_slot(
        lora_server, adapters, offline_texts):
    with _client(lora_server) as http:
        r = http.post("/v1/load_lora_adapter",
                      json={"lora_name": "ad2b", "lora_path": adapters["ad2"]})
        assert r.status_code == 200, r.text

    async def run() -> list[tuple[str, str]]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=lora_server.url, headers=headers,
                                     timeout=120) as client:
            models = [TINY_NAME, "ad1", "ad2b"] * 4

            async def one(model: str) -> tuple[str, str]:
                r = await client.post("/v1/completions", json={
                    "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                return model, r.json()["choices"][0]["text"]

            return await asyncio.gather(*(one(m) for m in models))

    expected = {TINY_NAME: offline_texts[None], "ad1": offline_texts["ad1"],
                "ad2b": offline_texts["ad2"]}
    for model, text in asyncio.run(run()):
        assert text == expected[model], model
    with _client(lora_server) as http:
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "ad2b"}).status_code == 200
        # Every request's blocks came back (the stats refresh every 0.2 s).
        deadline = time.monotonic() + 10
        while True:
            metrics = http.get("/metrics").text
            if (metric_value(metrics, "pagedlm:num_requests_running") == 0
                    and metric_value(metrics, "pagedlm:kv_cache_usage_perc") == 0):
                break
            assert time.monotonic() < deadline, metrics
            time.sleep(0.1)


def test_metrics_name_the_adapters_of_running_requests(lora_server):
    """vLLM's lora_requests_info gauge: while an adapter's request streams, it is listed as
    running; slot loads are counted."""
    import json

    body = {"model": "ad1", "prompt": PROMPT, "max_tokens": 900, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with _client(lora_server) as http, http.stream("POST", "/v1/completions",
                                                   json=body) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["model"] == "ad1"
        deadline = time.monotonic() + 10
        while True:
            with _client(lora_server) as probe:
                metrics = probe.get("/metrics").text
            labels = {"running_lora_adapters": "ad1", "waiting_lora_adapters": "",
                      "max_lora": "1"}
            if metric_value(metrics, "pagedlm:lora_requests_info", labels) > 0:
                break
            assert time.monotonic() < deadline, metrics
            time.sleep(0.1)
        assert metric_value(metrics, "pagedlm:lora_loads_total") >= 1
