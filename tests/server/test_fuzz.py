"""Schemathesis against /openapi.json: generated requests that fit the schema and ones that
violate it, on every endpoint, a bounded number per endpoint (the reliability suite runs
thousands: tests/stress/test_schemathesis_stress.py).

Our schema must match what the server accepts: nothing answers 5xx, a schema-violating
request gets a 4xx, a schema-valid one a 2xx or one of the cross-field 400s a JSON Schema
cannot state (tests/server/fuzz_rules.py)."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from tests.server.conftest import TINY_NAME  # noqa: E402
from tests.server.fuzz_rules import bound_generation, describe, judge  # noqa: E402

MAX_EXAMPLES = 12


@pytest.fixture
def api_schema(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=server.headers,
                                           timeout=30)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                    max_examples=MAX_EXAMPLES)
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


# No shrinking: a request that kills the engine would shrink to whatever fails after it.
@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=True, phases=[Phase.explicit, Phase.generate])
def test_answers_follow_the_schema(case, server):
    bound_generation(case)
    response = case.call(base_url=server.url, headers=server.headers, timeout=60)
    verdict = judge(case, response)
    assert verdict.status < 500, describe(case, response, verdict)  # no server errors
    assert verdict.problem is None, describe(case, response, verdict)


def test_openapi_states_startup_limits(http):
    """/openapi.json names the served models and the model's vocabulary and context."""
    spec = http.get("/openapi.json").json()
    models = spec["components"]["schemas"]
    completion = models["CompletionRequest"]["properties"]

    def leaves(prop, kind):
        return [s for s in prop.get("anyOf", [prop]) if s.get("type") == kind]

    assert leaves(completion["model"], "string")[0]["enum"] == [TINY_NAME, "alias"]
    assert leaves(completion["model"], "null")  # still optional
    assert leaves(completion["max_tokens"], "integer")[0]["maximum"] == 1023
    assert leaves(completion["top_k"], "integer")[0]["maximum"] == 49152
    assert leaves(completion["stop_token_ids"], "array")[0]["items"]["maximum"] == 49151
    assert leaves(completion["seed"], "integer")[0]["maximum"] == 2**63 - 1
    token_lists = leaves(completion["prompt"], "array")
    assert {"maximum": 49151, "minimum": 0, "type": "integer"} in (
        [t["items"] for t in token_lists] + [t["items"].get("items") for t in token_lists])
    assert models["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == 49151
    parameter = spec["paths"]["/v1/models/{model_id}"]["get"]["parameters"][0]
    assert parameter["schema"]["enum"] == [TINY_NAME, "alias"]
    assert all("422" not in op["responses"] for path in spec["paths"].values()
               for op in path.values())
    assert "HTTPValidationError" not in models
    ids = [op["operationId"] for path in spec["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids))
