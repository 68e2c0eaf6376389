"""The `pagedlm` command: generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from pagedlm.benchmarks.cli import add_bench_parser
from pagedlm.config import EngineArgs
from pagedlm.engine.core_launch import launch_core
from pagedlm.entrypoints.cli_args import (
    add_engine_args,
    add_sampling_args,
    engine_kwargs,
    parse_bytes,
)
from pagedlm.entrypoints.openai import (
    DEFAULT_MAX_NUM_QUEUED_REQUESTS,
    DEFAULT_MAX_REQUEST_BODY_SIZE,
    DEFAULT_MAX_TOKENS,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    check_port_free,
)
from pagedlm.entrypoints.openai.tool_parsers.formats import TOOL_CALL_FORMATS


def cmd_generate(args: argparse.Namespace) -> int:
    # deferred: generate loads the engine (torch); building the parser must not
    from pagedlm.entrypoints.generate import run_generate

    return run_generate(args)


def cmd_chat(args: argparse.Namespace) -> int:
    # deferred: chat loads the engine (torch); building the parser must not
    from pagedlm.entrypoints.chat import run_chat

    return run_chat(args)


def _parse_origins(text: str) -> list[str]:
    """A JSON list ('["http://localhost:3000"]', vLLM's form) or comma-separated origins."""
    text = text.strip()
    if text.startswith("["):
        try:
            origins = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list of origins: {e}") from e
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return origins
    return [o.strip() for o in text.split(",") if o.strip()]


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 for all)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients pass as \"model\" (default: the model argument)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) to serve under these model names "
                        "(with --enable-lora; more can be added with POST "
                        "/v1/load_lora_adapter)")
    g.add_argument("--api-key", default=os.environ.get("PAGEDLM_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $PAGEDLM_API_KEY; none = open)")
    g.add_argument("--allowed-origins", type=_parse_origins, default=[],
                   help="CORS origins, a JSON list or comma-separated (default: CORS off)")
    g.add_argument("--max-num-queued-requests", type=int, default=DEFAULT_MAX_NUM_QUEUED_REQUESTS,
                   help="answer 503 when this many requests are waiting")
    g.add_argument("--max-request-body-size", type=parse_bytes,
                   default=DEFAULT_MAX_REQUEST_BODY_SIZE,
                   help="largest request body in bytes (suffixes K/M/G); larger is a 413")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV blocks of shared prompt prefixes (default: the engine's)")
    g.add_argument("--max-tokens-default", type=int, default=DEFAULT_MAX_TOKENS,
                   help="max_tokens of a request that sets none (chat; completions with "
                        "max_tokens null), or less if the context has less room left")
    g.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM/SIGINT, seconds running requests get to finish before "
                        "they are ended with an error (new requests get 503 meanwhile; a "
                        "second signal stops at once)")
    g.add_argument("--tool-call-parser", default="auto",
                   choices=["auto", *TOOL_CALL_FORMATS],
                   help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>; "
                        "Hermes, Qwen), llama3_json or mistral ([TOOL_CALLS]); auto reads it "
                        "from the chat template, hermes when the template has no tool support "
                        "(the tools are then described in a system prompt)")
    g.add_argument("--disable-dashboard", action="store_true",
                   help="serve no live dashboard (/dashboard, /dashboard/state, "
                        "/dashboard/events; by default on, behind --api-key like the API)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log (one line per HTTP request at info)")


def cmd_serve(args: argparse.Namespace) -> int:
    if args.log_level is None:
        logging.getLogger("pagedlm").setLevel(logging.INFO)
    if args.max_num_queued_requests < 1:
        raise ValueError(f"--max-num-queued-requests must be >= 1, got {args.max_num_queued_requests}")
    if args.max_request_body_size < 1:
        raise ValueError(f"--max-request-body-size must be >= 1, got {args.max_request_body_size}")
    if args.max_tokens_default < 1:
        raise ValueError(f"--max-tokens-default must be >= 1, got {args.max_tokens_default}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    kwargs = engine_kwargs(args)
    if args.enable_prefix_caching is not None:
        kwargs["enable_prefix_caching"] = args.enable_prefix_caching
    check_port_free(args.host, args.port)  # before minutes of loading, not after
    logging.getLogger("pagedlm.entrypoints.cli").info(
        "starting: the engine core loads %s in its own process while this one starts the "
        "server", kwargs.get("model") or "the default model")
    # The engine core's process starts now (fetching the model first if need be): its
    # imports and model load run while this process imports the server and loads the
    # tokenizer, instead of after.
    launch = launch_core(EngineArgs(**kwargs), args.max_num_queued_requests)
    try:
        # deferred: the server loads FastAPI and the engine; building the parser must not
        from pagedlm.entrypoints.openai.api_server import run_server

        return run_server(args, kwargs, launch)
    finally:
        launch.abandon()  # if the server never took it over (it stops it otherwise)


def cmd_top(args: argparse.Namespace) -> int:
    # deferred: top loads rich; building the parser must not
    from pagedlm.entrypoints.top import run_top

    if not args.interval > 0:
        raise ValueError(f"--interval must be > 0 seconds, got {args.interval}")
    return run_top(args.url, args.api_key, args.interval, args.once)


class _HelpFormatter(argparse.HelpFormatter):
    """Each flag's help ends with its default, unless the help already says it or there is
    none worth saying (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text.lower() or default in (None, False, argparse.SUPPRESS)
                or not action.option_strings):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, list) else default
        return f"{text} (default: {shown})"


LOG_LEVEL_HELP = "logging level: debug, info, warning, error (default: warning; serve: info)"


def _finish_subcommands(parser: argparse.ArgumentParser) -> None:
    """Every subcommand (bench's too): its own help formatter, --log-level after the
    subcommand as well as before, and itself recorded so that main() reports an unknown
    flag with that subcommand's usage."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for sub in action.choices.values():
            sub.formatter_class = _HelpFormatter
            if "--log-level" not in sub._option_string_actions:
                sub.add_argument("--log-level", default=argparse.SUPPRESS, help=LOG_LEVEL_HELP)
            sub.set_defaults(_parser=sub)
            _finish_subcommands(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedlm", description="pagedlm: fast LLM inference")
    parser.add_argument("--log-level", default=None, help=LOG_LEVEL_HELP)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a reply to one or more prompts",
                         usage="pagedlm generate [MODEL] -p PROMPT [-p PROMPT ...] [options]")
    gen.add_argument("-p", "--prompt", action="append", default=None,
                     help="prompt text; repeat for several prompts, run one after another")
    gen.add_argument("--no-chat-template", action="store_true",
                     help="complete the raw text instead of wrapping it as a user chat message")
    add_sampling_args(gen, max_tokens=256)
    add_engine_args(gen)  # MODEL is positional, as for chat, serve and bench
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal, streamed")
    chat.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(chat, max_tokens=1024)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(func=cmd_serve)

    top = sub.add_parser("top", help="a running server's engine in the terminal: KV blocks, "
                                     "requests, throughput (what /dashboard shows)")
    top.add_argument("url", nargs="?", default="http://127.0.0.1:8000",
                     help="the server's address")
    top.add_argument("--api-key", default=os.environ.get("PAGEDLM_API_KEY") or None,
                     help="the server's --api-key (default: $PAGEDLM_API_KEY)")
    top.add_argument("--interval", type=float, default=0.5, help="seconds between refreshes")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.set_defaults(func=cmd_top)

    add_bench_parser(sub)
    _finish_subcommands(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # with the subcommand's usage, not the top level's
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=(args.log_level or "WARNING").upper(),
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
            PermissionError) as e:
        # A problem the user can fix: one line (--log-level debug shows the traceback).
        logging.getLogger("pagedlm").debug("the traceback of the error below", exc_info=True)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
