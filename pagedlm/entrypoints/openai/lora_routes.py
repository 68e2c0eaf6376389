"""LoRA adapters over HTTP, as vLLM serves them: an adapter is a model name. Requests pick
it with their `model` field; `/v1/models` lists it with the base model as its parent;
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (behind the API key, like every
path but /health) add and remove adapters while serving. The routes exist only when the
engine has LoRA enabled (--enable-lora)."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.entrypoints.openai.errors import APIError, bad_request
from pagedlm.entrypoints.openai.protocol.common import ErrorResponse
from pagedlm.entrypoints.openai.protocol.utility import (
    LoadLoRAAdapterRequest,
    ModelCard,
    UnloadLoRAAdapterRequest,
)
from pagedlm.entrypoints.openai.serving import Serving

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404)}


def parse_lora_modules(values: Sequence[str]) -> list[tuple[str, str]]:
    """`--lora-modules name=path ...` -> [(name, path)]; ValueError naming a bad entry."""
    modules = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules entries are name=path, got {value!r}")
        if name in (n for n, _ in modules):
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules.append((name, path))
    return modules


async def add_adapter(engine: AsyncLLMEngine, serving: Serving, name: str, path: str) -> None:
    """Load an adapter under `name`; ValueError saying why it cannot be."""
    if name in serving.served_model_names:
        raise ValueError(f"lora_name {name!r} is the base model's name; choose another")
    await engine.add_lora(name, path)


def adapter_cards(engine: AsyncLLMEngine, serving: Serving) -> list[ModelCard]:
    return [ModelCard(id=name, root=request.lora_path, parent=serving.model_name,
                      max_model_len=engine.max_model_len)
            for name, request in engine.lora_requests.items()]


def add_lora_routes(app: FastAPI, engine: AsyncLLMEngine, serving: Serving) -> None:
    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        try:
            await add_adapter(engine, serving, body.lora_name, body.lora_path)
        except ValueError as e:
            raise bad_request(str(e), param="lora_path") from e
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        try:
            await engine.remove_lora(body.lora_name)
        except LookupError as e:
            raise APIError(404, str(e.args[0]), param="lora_name", code="model_not_found") from e
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
