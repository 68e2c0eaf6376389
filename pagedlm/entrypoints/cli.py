"""The `pagedlm` command: generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from pagedlm.config import GiB


def _parse_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": GiB, "kib": 1 << 10, "mib": 1 << 20, "gib": GiB}
    t = text.strip().lower()
    for suffix in sorted(units, key=len, reverse=True):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * units[suffix])
    return int(t)


def add_engine_args(p: argparse.ArgumentParser, positional_model: bool = True) -> None:
    g = p.add_argument_group("engine")
    model_help = ("HF model directory, .gguf file or Hugging Face repo id org/name "
                  "(default: the embedded SmolLM2-135M-Instruct)")
    if positional_model:
        g.add_argument("model", nargs="?", default=None, help=model_help)
        g.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    else:
        g.add_argument("--model", dest="model_flag", default=None, metavar="MODEL", help=model_help)
    g.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hugging Face repo id MODEL (default: main)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer directory, if not the model's own")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="no tokenizer: prompts as token ids, outputs as token ids")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"],
                   help="weights file format (auto: from the files; dummy: random weights of "
                        "the right shapes, for benchmarks)")
    g.add_argument("--dtype", default="auto",
                   help="compute dtype: auto (float32 on CPU, the model's on GPUs), float32, "
                        "float16, bfloat16")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: a GPU if there is one, else the CPU")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the engine's random sampling (requests without a seed)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context, as far "
                        "as the KV cache holds it)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="most sequences decoding at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="most tokens one step computes (default: CPU 2048, GPU 8192)")
    g.add_argument("--max-prefill-tokens-with-decodes", type=int, default=None,
                   help="prompt tokens a step may compute while requests are decoding, so "
                        "no stream waits behind a whole long prompt (default: CPU 128, GPU "
                        "2048)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' (also prompt_lookup_min, '
                        'prompt_lookup_max, disable_by_batch_size); outputs are unchanged')
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT format) over the base model, chosen per "
                        "request and mixed in one batch")
    g.add_argument("--max-loras", type=int, default=1,
                   help="LoRA adapters resident at once (others load on demand, least "
                        "recently used out)")
    g.add_argument("--max-lora-rank", type=int, default=16,
                   help="highest adapter rank accepted (slots are sized for it)")
    g.add_argument("--kv-cache-memory", type=_parse_bytes, default=None,
                   help="KV cache size in bytes (suffixes K/M/G accepted); CPU default 2G")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of GPU memory the engine may use, KV cache included")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run every step through the model's Python layers: no CUDA graphs on GPUs, "
                        "no C++ decoder on CPU")
    g.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "float16", "bfloat16", "half", "bf16", "fp16", "fp32",
                            "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="KV cache storage type (auto: the model dtype; fp8 = fp8_e4m3: one byte "
                        "per value, with a scale per layer for K and V calibrated at start)")
    g.add_argument("--weight-dtype", default="auto", choices=["auto", "float16", "half", "fp16", "q8"],
                   help="CPU float32 models. float16: linear weights stored in float16 and "
                        "multiplied in float32 (half the weight bytes per step). q8: integer "
                        "matmuls as llama.cpp computes them: GGUF Q4_1/Q8_0 weights as stored "
                        "(others rounded to Q8_0), activations rounded to int8 per 32 values")
    g.add_argument("--num-threads", type=int, default=None,
                   help="CPU threads (per rank with --tensor-parallel-size; default: the "
                        "machine's cores, split evenly between ranks)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model's heads, MLP and vocabulary over this many ranks, one "
                        "worker process each (gloo on CPU, NCCL on GPUs)")
    g.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "ray"],
                   help="how ranks run: mp = worker processes on this machine; ray = actors "
                        "on the nodes of a running Ray cluster (ray start; RAY_ADDRESS), "
                        "for several machines")
    g.add_argument("--attention-backend", default="auto",
                   choices=["auto", "cpu", "torch", "triton", "reference"],
                   help="paged-attention implementation (auto: the C++ kernels on CPU, torch on "
                        "GPUs; triton: GPU kernels, which CUDA graphs need)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model_flag or getattr(args, "model", None), revision=args.revision,
        tokenizer=args.tokenizer,
        skip_tokenizer_init=args.skip_tokenizer_init, load_format=args.load_format,
        dtype=args.dtype, device=args.device, seed=args.seed, max_model_len=args.max_model_len,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
        max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        num_threads=args.num_threads, attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype, weight_dtype=args.weight_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        speculative_config=args.speculative_config, enable_lora=args.enable_lora,
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
    )


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens,
                   help="most tokens in a reply")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (the same reply every time); higher: more varied")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of tokens with this much probability")
    g.add_argument("--top-k", type=int, default=0,
                   help="sample from the k most likely tokens (0: all)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this times the most likely one")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="above 1: tokens already in the text become less likely")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="seed of this run's sampling (default: the engine's --seed)")


def sampling_params(args: argparse.Namespace):
    from pagedlm import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
    )


def describe_sampling(params) -> str:
    """The sampling settings in one line, as generate and chat state them."""
    parts = ["greedy" if params.temperature == 0 else f"temperature {params.temperature:g}"]
    if params.temperature != 0:
        parts += [f"top-p {params.top_p:g}"] if params.top_p < 1 else []
        parts += [f"top-k {params.top_k}"] if params.top_k > 0 else []
        parts += [f"min-p {params.min_p:g}"] if params.min_p > 0 else []
    if params.repetition_penalty != 1:
        parts.append(f"repetition penalty {params.repetition_penalty:g}")
    parts.append(f"at most {params.max_tokens} tokens")
    return "sampling: " + ", ".join(parts) + " (see --help to change)"


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedlm import LLM

    if not args.prompt:
        hint = ""
        if args.model and not os.path.exists(args.model):
            hint = f"; {args.model!r} is not a model path: did you mean --prompt {args.model!r}?"
        args._parser.error(f"give the prompt with -p/--prompt{hint}")
    llm = LLM(**engine_kwargs(args))
    params = sampling_params(args)
    print(describe_sampling(params), file=sys.stderr)  # stdout stays the replies alone
    tokenizer = llm.get_tokenizer()
    use_chat = not args.no_chat_template and tokenizer is not None and getattr(tokenizer, "chat_template", None)
    for prompt in args.prompt:
        if use_chat:
            outputs = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
        else:
            outputs = llm.generate(prompt, params, use_tqdm=False)
        for completion in outputs[0].outputs:
            print(completion.text if tokenizer is not None else completion.token_ids)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
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
    from pagedlm.entrypoints.openai import (
        DEFAULT_MAX_NUM_QUEUED_REQUESTS,
        DEFAULT_MAX_REQUEST_BODY_SIZE,
        DEFAULT_MAX_TOKENS,
        DEFAULT_SHUTDOWN_TIMEOUT_S,
    )
    from pagedlm.entrypoints.openai.tool_parsers.formats import TOOL_CALL_FORMATS

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
    g.add_argument("--max-request-body-size", type=_parse_bytes,
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
    from pagedlm.entrypoints.openai.api_server import run_server

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
    return run_server(args, engine_kwargs(args))


def cmd_top(args: argparse.Namespace) -> int:
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

    from pagedlm.benchmarks.cli import add_bench_parser

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
