"""Schemathesis against /openapi.json: generated and schema-violating requests on every
endpoint, a bounded number per endpoint. Nothing may answer 5xx."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

MAX_EXAMPLES = 12
# Generation length is not what this test is about; a fuzzed max_tokens of 900 with n=16
# would spend minutes decoding. Values >= the context (1024) are kept: they test the limit.
MAX_FUZZ_TOKENS = 8


def _bound_generation(body: object) -> None:
    if not isinstance(body, dict) or not ("prompt" in body or "messages" in body):
        return
    keys = ("max_tokens", "max_completion_tokens")
    for key in keys:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and MAX_FUZZ_TOKENS < value < 1024:
            body[key] = MAX_FUZZ_TOKENS
    if all(body.get(key) is None for key in keys):
        body["max_tokens"] = MAX_FUZZ_TOKENS


@pytest.fixture
def api_schema(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=server.headers,
                                           timeout=30)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                    max_examples=MAX_EXAMPLES)
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=True)
def test_no_server_errors(case, server):
    _bound_generation(case.body)
    response = case.call(base_url=server.url, headers=server.headers, timeout=60)
    assert response.status_code < 500, (
        f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}\n"
        f"body: {str(case.body)[:500]}")
