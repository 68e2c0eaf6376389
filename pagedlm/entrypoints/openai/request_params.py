"""A generation request's fields into SamplingParams: the fields the schema accepts but this
server does not implement, the one output constraint a request may carry, and its grammar
compiled (so validated) before anything is queued. Errors are 400s naming the field."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedlm.entrypoints.openai.errors import bad_request
from pagedlm.entrypoints.openai.protocol.common import SamplingFields
from pagedlm.entrypoints.openai.serving import Serving
from pagedlm.sampling_params import SamplingParams
from pagedlm.structured import StructuredOutputsParams

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# Request fields copied to SamplingParams under the same name when not None.
_PASSTHROUGH = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop",
                "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
                "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                "spaces_between_special_tokens", "length_penalty")



def check_common_fields(req: SamplingFields) -> None:
    """400s for fields the schema accepts but this server does not implement."""
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true",
                          param="stream_options")
    for name, neutral in (("best_of", req.n or 1), ("use_beam_search", False)):
        value = getattr(req, name)
        if value is not None and value != neutral and name not in _SAMPLING_FIELDS:
            raise bad_request(f"{name} is not supported by this engine", param=name)


def build_sampling_params(req: SamplingFields, *, max_tokens: int | None,
                          logprobs: int | None, prompt_logprobs: int | None = None,
                          field_names: dict[str, str] | None = None) -> SamplingParams:
    """The request's SamplingParams; a ValueError becomes a 400 naming the field.

    `field_names` maps a SamplingParams field to the request's name for it (chat's
    max_completion_tokens) so that `param` is what the client sent."""
    kwargs: dict[str, Any] = {name: getattr(req, name) for name in _PASSTHROUGH
                              if getattr(req, name) is not None}
    kwargs.update(n=req.n or 1, max_tokens=max_tokens, logprobs=logprobs,
                  prompt_logprobs=prompt_logprobs)
    for name in ("best_of", "use_beam_search"):
        if name in _SAMPLING_FIELDS and getattr(req, name) is not None:
            kwargs[name] = getattr(req, name)
    structured, structured_param = structured_outputs_of(req)
    kwargs["structured_outputs"] = structured
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        message = str(e)
        if structured is not None and "structured_outputs" in message:
            raise bad_request(message, param=structured_param) from e
        field = message.split(" ", 1)[0]
        param = field if field in _SAMPLING_FIELDS else None
        if param is not None and field_names:
            param = field_names.get(param, param)
        raise bad_request(message, param=param) from e


def structured_outputs_of(req: SamplingFields) -> tuple[StructuredOutputsParams | None, str]:
    """The request's output constraint and the field it came from: OpenAI's
    response_format, vLLM's structured_outputs or guided_* (at most one of them)."""
    sources: list[tuple[str, dict]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        sources.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema",
                              param="response_format")
        sources.append(("response_format", {"json": fmt.json_schema.json_schema}))
    if req.structured_outputs is not None:
        fields = req.structured_outputs.model_dump(exclude_none=True)
        sources.append(("structured_outputs",
                        {("json" if k == "json_" else k): v for k, v in fields.items()}))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            sources.append((name, {key: getattr(req, name)}))
    if not sources:
        return None, ""
    if len(sources) > 1:
        raise bad_request(f"send one output constraint, not {len(sources)}: "
                          f"{', '.join(name for name, _ in sources)}", param=sources[1][0])
    param, fields = sources[0]
    try:
        return StructuredOutputsParams(**fields), param
    except ValueError as e:
        raise bad_request(str(e), param=param) from e


async def compile_structured_outputs(serving: Serving, req: SamplingFields,
                                     params: SamplingParams) -> None:
    """Compile (and so validate) the grammar before anything is queued, off the event
    loop: an invalid schema, regex or grammar, or an unsupported schema feature, is a 400
    naming the field and the problem."""
    structured = params.structured_outputs
    if structured is None:
        return
    try:
        await serving.run_off_loop(structured.grammar_text)
    except ValueError as e:
        raise bad_request(str(e), param=structured_outputs_of(req)[1]) from e
