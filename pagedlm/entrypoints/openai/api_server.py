"""`pagedlm serve`: the FastAPI app and the uvicorn server around an AsyncLLMEngine.

    drain (503 once shutting down) -> CORS (only with --allowed-origins)
      -> API key (all but /health) -> body size limit -> FastAPI routes (and /dashboard) -> Serving* -> AsyncLLMEngine (frontend) ==pipe==> engine core process
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.responses import Response

import pagedlm
from pagedlm.config import EngineArgs
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.core_launch import CoreLaunch
from pagedlm.entrypoints.openai import DEFAULT_MAX_REQUEST_BODY_SIZE, DEFAULT_MAX_TOKENS
from pagedlm.entrypoints.openai.dashboard import DashboardHub, add_dashboard_routes
from pagedlm.entrypoints.openai.errors import (
    bad_request,
    error_response,
    install_exception_handlers,
)
from pagedlm.entrypoints.openai.http_protocol import openai_http_protocol
from pagedlm.entrypoints.openai.lifecycle import DrainingServer, DrainMiddleware
from pagedlm.entrypoints.openai.lora_routes import (
    adapter_cards,
    add_adapter,
    add_lora_routes,
    parse_lora_modules,
)
from pagedlm.entrypoints.openai.metrics import ServerMetrics
from pagedlm.entrypoints.openai.openapi import refine_openapi
from pagedlm.entrypoints.openai.protocol.chat import ChatCompletionRequest, ChatCompletionResponse
from pagedlm.entrypoints.openai.protocol.common import ErrorResponse
from pagedlm.entrypoints.openai.protocol.completion import CompletionRequest, CompletionResponse
from pagedlm.entrypoints.openai.protocol.utility import (
    DetokenizeRequest,
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from pagedlm.entrypoints.openai.security import ApiKeyMiddleware, BodySizeLimitMiddleware
from pagedlm.entrypoints.openai.serving import Serving
from pagedlm.entrypoints.openai.serving_chat import ChatServing
from pagedlm.entrypoints.openai.serving_completion import CompletionServing

logger = logging.getLogger(__name__)

# Niceness of the server's frontend threads, relative to the engine core process
# (PAGEDLM_FRONTEND_NICE overrides; 0 = same priority). Measured on 2 cores, ShareGPT-64 at
# rate inf: 457 vs 441 output tok/s (two runs each), the frontend using ~1.4 CPU-s of ~64
# (benchmarks/cpu/serving_cpu_split.py --frontend-nice 10 / 0).
FRONTEND_NICE = 10

# After the engine core dies, the server answers 503 on /health this long, then exits.
ENGINE_DEAD_EXIT_S = 5.0

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 503)}
_STREAMING = {"content": {"text/event-stream": {}}}


def build_app(engine: AsyncLLMEngine, served_model_names: Sequence[str], *,
              api_key: str | None = None, allowed_origins: Sequence[str] = (),
              max_request_body_size: int = DEFAULT_MAX_REQUEST_BODY_SIZE,
              max_tokens_default: int = DEFAULT_MAX_TOKENS,
              tool_call_parser: str = "auto", enable_dashboard: bool = True,
              lora_modules: Sequence[tuple[str, str]] = ()) -> FastAPI:
    """The OpenAI-compatible app. Its lifespan starts and stops the engine (and loads
    `lora_modules`, (name, path) adapters, first)."""
    serving = Serving(engine, served_model_names, max_tokens_default, tool_call_parser)
    completions = CompletionServing(serving)
    chat = ChatServing(serving)
    metrics = ServerMetrics(engine, serving.model_name)
    engine.add_output_listener(metrics.observe)
    hub = DashboardHub(engine, metrics) if enable_dashboard else None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            for name, path in lora_modules:
                await add_adapter(engine, serving, name, path)
            yield
        finally:
            engine.shutdown()
            serving.close()

    app = FastAPI(title="pagedlm OpenAI-compatible server", version=pagedlm.__version__,
                  lifespan=lifespan)
    def openapi() -> dict:  # FastAPI's schema plus the limits known only now, built once
        if app.openapi_schema is None:
            app.openapi_schema = refine_openapi(
                FastAPI.openapi(app), served_model_names=serving.served_model_names,
                max_model_len=engine.max_model_len, vocab_size=engine.vocab_size)
        return app.openapi_schema
    app.openapi = openapi  # type: ignore[method-assign]
    install_exception_handlers(app)
    # Starlette runs the middleware added last first: CORS, then the key, then the size.
    app.add_middleware(BodySizeLimitMiddleware, max_body_size=max_request_body_size)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"])

    @app.api_route("/health", methods=["GET", "HEAD"], response_model=HealthResponse,
                   responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if not engine.is_healthy:
            return error_response(503, "the engine is not running", code="engine_dead")
        return JSONResponse(HealthResponse().model_dump())

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=pagedlm.__version__)

    def model_card(name: str) -> ModelCard:
        return ModelCard(id=name, root=engine.model_path, max_model_len=engine.max_model_len)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=[model_card(name) for name in serving.served_model_names]
                         + adapter_cards(engine, serving))

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def retrieve_model(model_id: str) -> ModelCard:
        serving.check_model(model_id)
        return next((c for c in adapter_cards(engine, serving) if c.id == model_id),
                    None) or model_card(model_id)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {}},
                              "description": "Prometheus text exposition format"}})
    async def get_metrics() -> Response:
        content, content_type = metrics.render()
        return Response(content, media_type=content_type)

    @app.post("/v1/completions", responses={200: {"model": CompletionResponse, **_STREAMING},
                                            **_ERRORS})
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create(body, raw_request)

    @app.post("/v1/chat/completions",
              responses={200: {"model": ChatCompletionResponse, **_STREAMING}, **_ERRORS})
    async def create_chat_completion(body: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        return await chat.create(body, raw_request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            _, tokens = await serving.render_chat(body.messages, body.add_generation_prompt)
        else:
            assert body.prompt is not None
            tokens = await serving.tokenize(body.prompt, body.add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len,
                                tokens=tokens)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        serving.check_model(body.model)
        vocab_size = engine.vocab_size
        bad = next((t for t in body.tokens if t >= vocab_size), None)
        if bad is not None:
            raise bad_request(f"tokens contains {bad}, outside the vocabulary [0, {vocab_size})",
                              param="tokens")
        return DetokenizeResponse(prompt=await serving.detokenize(body.tokens, "tokens"))

    if hub is not None:
        add_dashboard_routes(app, hub)
    if engine.lora_enabled:
        add_lora_routes(app, engine, serving)
    return app


# ----- the command ------------------------------------------------------------------------------


def default_served_model_name(model_arg: str | None, model_path: str) -> str:
    """The name clients use in "model": the --model argument as given (as vLLM does), or
    for the embedded default a readable name (the file name less quantization tags)."""
    if model_arg:
        return model_arg
    name = Path(model_path).name
    name = re.sub(r"\.gguf$", "", name, flags=re.IGNORECASE)
    return re.sub(r"[.-](Q\d\w*|IQ\d\w*|F16|F32|BF16)$", "", name, flags=re.IGNORECASE)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run_server(args: argparse.Namespace, engine_kwargs: dict,
               launch: CoreLaunch | None = None) -> int:
    """Load the engine (taking over `launch`, its core process if already started), then
    serve until interrupted."""
    import uvicorn

    if not args.api_key and not _is_loopback(args.host):
        logger.warning("listening on %s without --api-key: anyone who can reach this address "
                       "can use the model", args.host)
    lora_modules = parse_lora_modules(args.lora_modules or [])
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(**engine_kwargs), max_num_queued_requests=args.max_num_queued_requests,
        launch=launch)
    # The core's compute threads come first on a machine with fewer cores than threads:
    # the frontend (this thread and the threads it starts from here on) yields to them.
    nice = int(os.environ.get("PAGEDLM_FRONTEND_NICE", str(FRONTEND_NICE)))
    if nice:
        os.nice(nice)
    names = args.served_model_name or [
        default_served_model_name(engine_kwargs.get("model"), engine.model_path)]
    app = build_app(engine, names, api_key=args.api_key, allowed_origins=args.allowed_origins,
                    max_request_body_size=args.max_request_body_size,
                    max_tokens_default=args.max_tokens_default,
                    tool_call_parser=args.tool_call_parser,
                    enable_dashboard=not args.disable_dashboard, lora_modules=lora_modules)
    host = args.host
    url_host = f"[{host}]" if ":" in host else host
    stats = engine.stats
    logger.info("serving %s (model %s on %s, engine core in process %s): %d KV blocks x %d "
                "tokens = %d tokens of KV cache", ", ".join(names), engine.model_path,
                engine.device, engine.client.pid, stats.num_blocks_total, stats.block_size,
                stats.num_blocks_total * stats.block_size)
    logger.info("OpenAI-compatible API at http://%s:%d/v1 (API key %s, CORS %s)", url_host,
                args.port, "required" if args.api_key else "off",
                ", ".join(args.allowed_origins) if args.allowed_origins else "off")
    if not args.disable_dashboard:
        logger.info("live dashboard at http://%s:%d/dashboard%s (in a terminal: pagedlm top)",
                    url_host, args.port, "?api_key=..." if args.api_key else "")
    drain = DrainMiddleware(app)
    config = uvicorn.Config(drain, host=host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=5, server_header=False,
                            http=openai_http_protocol())  # malformed HTTP: an OpenAI 400
    server = DrainingServer(config, drain, engine, args.shutdown_timeout)

    def exit_later() -> None:
        # /health answers 503 meanwhile, so a supervisor sees why the server goes away.
        logger.error("the engine core is gone: the server exits in %.0f s", ENGINE_DEAD_EXIT_S)
        asyncio.get_running_loop().call_later(ENGINE_DEAD_EXIT_S, setattr, server,
                                              "should_exit", True)

    engine.add_dead_listener(exit_later)
    try:
        server.run()
    finally:
        engine.shutdown()  # also when the lifespan never ran (the port was taken)
    return 1 if engine.dead_error is not None or server.forced else 0

