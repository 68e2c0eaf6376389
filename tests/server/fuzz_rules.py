"""What a schemathesis case against our own /openapi.json must get back, shared by
tests/server/test_fuzz.py (a few cases per endpoint, default run) and
tests/stress/test_schemathesis_stress.py (thousands).

- never a 5xx, as a status or as an error event inside a 200 event stream;
- a NEGATIVE case (the request violates the schema): a 4xx;
- a POSITIVE case (the request fits the schema): a 2xx, or a 400 for one of the
  cross-field rules below, which a JSON Schema cannot state; any other 400 means the
  schema promises more than the server accepts.

The mode is schemathesis' own label (`case.meta.generation.mode`), read after
`bound_generation` edited the body, so that schemathesis revalidates it first.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pagedlm.entrypoints.openai.protocol.common import MAX_TOOLS

# Generation length is not what the fuzzing is about: a fuzzed max_tokens of 900 with
# n=16 and 64 prompts would spend minutes decoding.
MAX_FUZZ_TOKENS = 8
MAX_MODEL_LEN = 1024  # --max-model-len of the test servers (TINY_ARGS)
GENERATING_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})

# The request fields an output constraint can come from (request_params.structured_outputs_of).
STRUCTURED_OUTPUT_SOURCES = ("response_format", "structured_outputs", "guided_json",
                             "guided_regex", "guided_choice", "guided_grammar")
# Schemathesis' probes of a wrong Content-Type: for an operation without a body, the header
# describes nothing, and answering it as usual is right.
CONTENT_TYPE_PROBES = frozenset({"malformed_content_type", "unsupported_content_type"})

# (param, reason): the 400s a schema-valid body may get. `param` is the error's `param`;
# `reason` is its `code` or a fragment of its message.
ALLOWED_400S: tuple[tuple[str, str], ...] = (
    # The prompt alone fills the context: the schema cannot count tokens.
    ("prompt", "context_length_exceeded"),
    ("messages", "context_length_exceeded"),
    # Prompt + max_tokens (or max_completion_tokens) over the context.
    ("max_tokens", "context_length_exceeded"),
    ("max_completion_tokens", "context_length_exceeded"),
    # min_tokens above max_tokens, or above what the context leaves when max_tokens is unset.
    ("min_tokens", "min_tokens must be <= max_tokens"),
    # Chat: top_logprobs needs logprobs: true.
    ("top_logprobs", "top_logprobs requires logprobs to be true"),
    # stream_options needs stream: true.
    ("stream_options", "stream_options is only allowed when stream is true"),
    # best_of below n.
    ("best_of", "best_of must be >= n"),
    # n (or best_of) x the number of prompts over --max-num-queued-requests.
    ("n", "the server queues at most"),
    # The model's chat template rejects the messages (e.g. roles that do not alternate).
    ("messages", "the chat template rejected the messages"),
    # /tokenize with both or neither of prompt and messages.
    ("prompt", "send exactly one of prompt and messages"),
    # use_beam_search with stop strings, min_tokens or logprobs.
    ("use_beam_search", "use_beam_search does not combine with"),
    # A prompt of characters the tokenizer drops (control characters) has no token left.
    ("prompt", "the prompt is empty"),
    # use_beam_search without max_tokens (chat has no default).
    ("max_tokens", "max_tokens must be set when use_beam_search is true"),
    # best_of or n over the engine's beam width.
    ("n", "beam width (best_of or n) must be <="),
    ("best_of", "beam width (best_of or n) must be <="),
    # structured_outputs with none or several of its fields set (nulls and false aside).
    ("structured_outputs", "structured_outputs: set exactly one of"),
    # response_format of type json_schema without json_schema.schema.
    ("response_format", "response_format of type json_schema needs json_schema.schema"),
    # tool_choice other than none without tools, naming a function not in tools, or
    # forcing a call while another output constraint is set.
    ("tool_choice", "needs tools"),
    ("tool_choice", "which is not in tools"),
    ("tool_choice", "constrains the output to a tool call"),
    # Two tools of one name; forced calls whose grammar does not compile.
    ("tools", "names must be unique"),
    ("tools", "the tools cannot be forced"),
) + tuple(
    # A function's parameters that are no usable JSON schema (the request schema types
    # them as an object; which objects are valid schemas it cannot say).
    (f"tools[{i}].function.parameters", "is not a usable JSON schema")
    for i in range(MAX_TOOLS)
) + tuple(
    (source, reason) for source in STRUCTURED_OUTPUT_SOURCES for reason in (
        # More than one source of an output constraint (param: the second one).
        "send one output constraint, not",
        # The JSON schema, regex or grammar does not compile: a JSON Schema can type these
        # strings but not say which are valid in their own languages.
        "structured_outputs.",
        # Beam search with an output constraint.
        "use_beam_search does not combine with structured_outputs",
    ))


def bound_generation(case: Any, max_model_len: int = MAX_MODEL_LEN) -> None:
    """Cap the generation length of a completion or chat body at MAX_FUZZ_TOKENS (lengths
    from the context up are kept: they test the limit), then let schemathesis revalidate
    the edited body, so that its mode describes what is sent."""
    body = case.body
    if isinstance(body, dict) and case.operation.path in GENERATING_PATHS:
        keys = ("max_tokens", "max_completion_tokens")
        for key in (*keys, "min_tokens"):
            value = body.get(key)
            if (isinstance(value, int) and not isinstance(value, bool)
                    and MAX_FUZZ_TOKENS < value < max_model_len):
                body[key] = MAX_FUZZ_TOKENS
        if all(body.get(key) is None for key in keys):
            body["max_tokens"] = MAX_FUZZ_TOKENS
    _ = case.meta  # revalidates an edited body


def is_negative(case: Any) -> bool:
    meta = case.meta
    return meta is not None and meta.generation.mode.is_negative


def is_bodiless_content_type_probe(case: Any) -> bool:
    from schemathesis.core import NotSet

    meta = case.meta
    scenario = getattr(getattr(meta, "phase", None), "data", None)
    scenario = getattr(scenario, "scenario", None)
    return (str(getattr(scenario, "value", scenario)) in CONTENT_TYPE_PROBES
            and isinstance(case.body, NotSet))


def stream_error(response: Any) -> dict | None:
    """The first error event of an event stream, if any."""
    if not content_type(response).startswith("text/event-stream"):
        return None
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            try:
                event = json.loads(line[6:])
            except ValueError:
                return {"message": f"an event that is not JSON: {line[:200]}", "type": "?"}
            if isinstance(event, dict) and "error" in event:
                return event["error"]
    return None


def content_type(response: Any) -> str:
    value = response.headers.get("content-type", "")  # schemathesis: lowercase keys, lists
    return (value[0] if value else "") if isinstance(value, list) else value


def error_of(response: Any) -> dict:
    try:
        body = response.json()
    except ValueError:
        return {}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def has_whole_float(value: Any) -> bool:
    """Whether a body holds a float with no fraction (2.0). JSON Schema's integer admits
    it (OpenAPI 3.1, as FastAPI writes), so schemathesis sends it where an integer goes;
    pydantic's strict int refuses it."""
    if isinstance(value, float):
        return value.is_integer()
    if isinstance(value, dict):
        return any(has_whole_float(v) for v in value.values())
    if isinstance(value, list):
        return any(has_whole_float(v) for v in value)
    return False


def allowed_400(error: dict) -> tuple[str, str] | None:
    """The ALLOWED_400S rule this error is an instance of, if any."""
    message, code = str(error.get("message", "")), error.get("code")
    for param, reason in ALLOWED_400S:
        if error.get("param") == param and (reason == code or reason in message):
            return param, reason
    return None


@dataclass
class Verdict:
    negative: bool
    status: int  # an event stream's error event counts as its status (500 for a server error)
    rule: tuple[str, str] | None = None  # the allowed 400 a positive case got
    problem: str | None = None


def judge(case: Any, response: Any) -> Verdict:
    """Whether the answer to `case` is what its mode calls for (Verdict.problem if not)."""
    negative = is_negative(case)
    status = response.status_code
    streamed = stream_error(response) if status == 200 else None
    if streamed is not None:
        server_side = streamed.get("type") == "server_error" or str(
            streamed.get("code")) in ("internal_error", "engine_dead")
        status = 500 if server_side else 400
    verdict = Verdict(negative, status)
    if status >= 500:
        verdict.problem = "a server error"
    elif negative:
        if not 400 <= status < 500 and not is_bodiless_content_type_probe(case):
            verdict.problem = "a schema-violating request was not refused with a 4xx"
    elif status == 400:
        verdict.rule = allowed_400(error_of(response))
        if verdict.rule is None:
            verdict.problem = ("a schema-valid request was refused, not for one of the "
                               "cross-field rules in ALLOWED_400S")
    elif not 200 <= status < 300:
        verdict.problem = "a schema-valid request was not answered 2xx"
    return verdict


def describe(case: Any, response: Any, verdict: Verdict) -> str:
    """The problem, the answer and the body sent (its null fields left out)."""
    text = response.text
    streamed = stream_error(response)
    if streamed is not None:
        text = "event stream: " + json.dumps({"error": streamed})
    body = case.body
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if v is not None}
    elif not isinstance(body, (list, str, int, float, type(None))):
        body = repr(body)
    return (f"{verdict.problem}: {'negative' if verdict.negative else 'positive'} "
            f"{case.method} {case.formatted_path} -> {response.status_code}: {text[:300]}\n"
            f"    body (nulls left out): {json.dumps(body, default=repr)[:800]}")


@dataclass
class Tally:
    """Figures over many cases, and the problems grouped by kind (first example of each)."""

    cases: int = 0
    positive: int = 0
    negative: int = 0
    status_counts: Counter = field(default_factory=Counter)
    allowed_400s: Counter = field(default_factory=Counter)
    per_operation: Counter = field(default_factory=Counter)
    problem_counts: Counter = field(default_factory=Counter)
    problem_examples: dict[str, str] = field(default_factory=dict)

    def add(self, label: str, case: Any, response: Any, verdict: Verdict) -> None:
        self.cases += 1
        self.per_operation[label] += 1
        if verdict.negative:
            self.negative += 1
        else:
            self.positive += 1
        self.status_counts[str(verdict.status)] += 1
        if verdict.rule is not None:
            self.allowed_400s[f"{verdict.rule[0]}: {verdict.rule[1]}"] += 1
        if verdict.problem is not None:
            error = stream_error(response) or error_of(response)
            mode = "negative" if verdict.negative else "positive"
            if not verdict.negative and verdict.status == 400 and has_whole_float(case.body):
                # One cause, whichever field it hits first: see has_whole_float.
                kind = f"{label} {mode} -> 400: an integer spelled as a float (2.0)"
            else:
                message = re.split(r"[\"'\n]", str(error.get("message", "")))[0][:60]
                kind = (f"{label} {mode} -> {verdict.status} (param {error.get('param')}, "
                        f"code {error.get('code')}: {re.sub(r'[0-9]+', 'N', message)})")
            self.add_problem(kind, describe(case, response, verdict))

    def add_problem(self, kind: str, example: str) -> None:
        self.problem_counts[kind] += 1
        self.problem_examples.setdefault(kind, example)

    def problems(self, limit: int = 20) -> str:
        lines = [f"{sum(self.problem_counts.values())} problem(s) of "
                 f"{len(self.problem_counts)} kind(s):"]
        for kind, count in self.problem_counts.most_common(limit):
            lines.append(f"[{count}x] {kind}\n  e.g. {self.problem_examples[kind]}")
        return "\n".join(lines)
