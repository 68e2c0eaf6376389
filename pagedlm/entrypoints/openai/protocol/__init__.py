"""Pydantic models of the OpenAI API (the subset pagedlm serves) plus vLLM's extra fields.

Request models forbid unknown fields: a parameter we do not implement (`audio`, ...) is a
clear 400, not silently ignored output.
Fields that do not change generation (`user`, `store`, `metadata`, ...) are accepted.
Types are strict, as OpenAI checks them: `"max_tokens": "4"`, `"stream": "yes"` or `true`
as a token id are 400s, never coerced (an integer is accepted where a number is).
Limits that protect the server (n, logprobs, stop strings, prompt counts) and the ranges
SamplingParams enforces are part of the schema, so they also show up in /openapi.json.

    common.py      per-request limits, strict base models, errors, the sampling fields both
                   generation endpoints take, usage
    completion.py  /v1/completions: request, choices, logprobs, response
    chat.py        /v1/chat/completions: messages, tools, request, response, stream chunks
    utility.py     the endpoints around generation: models, tokenize, detokenize, health,
                   version, LoRA adapters
"""
