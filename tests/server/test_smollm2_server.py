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
from tests.server.conftest import ServerProcess, _start, stream_tool_calls

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


# ----- tool calling on the real model ---------------------------------------------------------

def _get_weather(city: str, unit: str = "celsius") -> str:
    return json.dumps({"city": city, "temperature": 18, "unit": unit, "sky": "sunny"})


def _calculator(expression: str) -> str:
    import ast
    import operator

    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv}

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"not arithmetic: {expression!r}")

    try:
        return str(ev(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"


FUNCTIONS = {"get_weather": _get_weather, "calculator": _calculator}
CALCULATOR_TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}


def _weather_tool():
    from typing import Literal

    import openai
    from pydantic import BaseModel

    class GetWeather(BaseModel):
        """The current weather in a city."""

        city: str
        unit: Literal["celsius", "fahrenheit"]

    return GetWeather, openai.pydantic_function_tool(GetWeather, name="get_weather")


def test_smollm2_tool_choices(smol_server):
    """auto, required and a named function on the real model, each whole and streamed
    (the stream rebuilt gives the same content and calls)."""
    import openai

    GetWeather, weather_tool = _weather_tool()
    client = openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    common = dict(model="SmolLM2-135M-Instruct", messages=messages,
                  tools=[weather_tool, CALCULATOR_TOOL], temperature=0,
                  max_completion_tokens=64, parallel_tool_calls=False)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("auto", "required", named):
        whole = client.chat.completions.create(**common, tool_choice=choice).choices[0]
        calls = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": c.function.arguments}}
            for c in whole.message.tool_calls or []]
        content, streamed, finish = stream_tool_calls(client.chat.completions.create(
            **common, tool_choice=choice, stream=True))
        assert (content or None, finish) == (whole.message.content, whole.finish_reason)
        assert [c["function"] for c in streamed] == [c["function"] for c in calls]
        assert "<tool_call>" not in (whole.message.content or "")
        assert (whole.finish_reason == "tool_calls") == bool(calls)
        if choice == "auto":
            continue  # this small model answers in words here; no markup leaked
        assert whole.message.content is None and len(calls) == 1
        assert calls[0]["function"]["name"] == "get_weather"
        GetWeather.model_validate_json(calls[0]["function"]["arguments"])
    # named, through the client's .parse(): the arguments come back as the pydantic object
    parsed = client.chat.completions.parse(
        **{**common, "tools": [weather_tool]},  # .parse() takes strict tools only
        tool_choice=named)
    (call,) = parsed.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_smollm2_agent_loop(smol_server):
    """A client loop as agent frameworks run it: call the model, run the tools it asks
    for, send the results back, until it answers in words. The client's tool_choice
    policy: a call first, then words (this 135M model, left to `auto` after a result,
    calls the same tool again and again; `auto` itself is covered above)."""
    import openai

    _, weather_tool = _weather_tool()
    client = openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="unused", max_retries=0)
    messages: list[dict] = [{"role": "user", "content": "What's the weather like in Paris?"}]
    ran: list[str] = []
    for choice in ("required", "none"):
        chunks = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, tools=[weather_tool,
                                                                     CALCULATOR_TOOL],
            tool_choice=choice, parallel_tool_calls=False, temperature=0,
            max_completion_tokens=96, stream=True)
        content, calls, finish = stream_tool_calls(chunks)
        if not calls:
            assert finish == "stop" and "<tool_call>" not in content
            break
        assert finish == "tool_calls"
        messages.append({"role": "assistant", "content": content or None,
                         "tool_calls": calls})
        for call in calls:
            try:  # as agent SDKs do, a call the function refuses is reported back
                result = FUNCTIONS[call["function"]["name"]](
                    **json.loads(call["function"]["arguments"]))
            except (TypeError, ValueError) as e:
                result = f"error: {e}"
            ran.append(call["function"]["name"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    assert ran == ["get_weather"]
    print(f"\nagent loop: tools run {ran}; answer {content!r}")
    # the answer draws on the tool's result (18 degrees, sunny), which only the tool knew
    assert "sunny" in content.lower() or "18" in content
