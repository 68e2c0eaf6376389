"""Served against offline throughput, and pagedlm's server against llama-server, on the
same ShareGPT requests, repeated, one JSON per run and a summary with ranges and ratios.

Per repeat, one after the other on the same machine (nothing else may run meanwhile):
  1. `pagedlm bench throughput` (offline `LLM`, in process);
  2. `pagedlm serve` + `pagedlm bench serving` at each request rate (Poisson, seed 0);
     (1 and 2 swap places in odd repeats, so that neither always runs first);
  3. `llama-server` (N slots, continuous batching, same GGUF) + `pagedlm bench serving` at
     the same rates (skipped without --llama-server).
Sampling everywhere: temperature 1, top-p 1, EOS ignored, so every request generates
exactly its ShareGPT output length.

usage: python benchmarks/serving_vs_offline.py [--repeats 3] [--num-prompts 64]
           [--rates inf 2 4] [--threads 2] [--llama-server PATH] [--slots 16]
           [--out DIR] [--serve-flag=--max-prefill-tokens-with-decodes=256 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ENGINE_FLAGS = ["--weight-dtype", "q8", "--kv-cache-dtype", "float16"]
SAMPLING_FLAGS = ["--temperature", "1.0", "--top-p", "1.0", "--ignore-eos"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagedlm.entrypoints.cli", *args]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {timeout_s} s; see {log}")


class Server:
    def __init__(self, cmd: list[str], log: Path) -> None:
        self.log = log
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _serve_rates(args, name: str, url: str, rates: list[str], repeat: int, out: Path,
                 extra: list[str]) -> None:
    for rate in rates:
        path = out / f"{name}_rate{rate}_r{repeat}.json"
        print(f"== {name}: rate {rate}, repeat {repeat} -> {path.name}", flush=True)
        subprocess.run(_cli("bench", "serving", "--base-url", url, "--dataset", "sharegpt",
                            "--num-prompts", str(args.num_prompts), "--seed", "0",
                            "--request-rate", rate, *SAMPLING_FLAGS, "--top-k", "0",
                            "--min-p", "0.0", "--label", f"{name} rate {rate}",
                            "--disable-tqdm", "--output-json", str(path), *extra), check=True)


def run(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = ["--num-threads", str(args.threads)]
    for repeat in range(args.first_repeat, args.first_repeat + args.repeats):
        if "pagedlm" not in args.engines:
            _run_llama_server(args, repeat, out)
            continue
        # Offline first in even repeats, served first in odd ones: on a VM the first of two
        # runs in a row often measures faster, which would favour one side every time.
        steps = [_offline, _served] if repeat % 2 == 0 else [_served, _offline]
        for step in steps:
            step(args, repeat, out, threads)
        if "llama-server" in args.engines:
            _run_llama_server(args, repeat, out)
    summary = summarize(out, args.rates)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


def _offline(args, repeat: int, out: Path, threads: list[str]) -> None:
    path = out / f"offline_r{repeat}.json"
    print(f"== offline, repeat {repeat} -> {path.name}", flush=True)
    subprocess.run(_cli("bench", "throughput", "--dataset", "sharegpt", "--num-prompts",
                        str(args.num_prompts), "--seed", "0", *ENGINE_FLAGS, *threads,
                        *args.serve_flag, "--ignore-eos", "--disable-tqdm",
                        "--output-json", str(path)), check=True)


def _served(args, repeat: int, out: Path, threads: list[str]) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = Server(_cli("serve", "--host", "127.0.0.1", "--port", str(port), *ENGINE_FLAGS,
                         *threads, *args.serve_flag, "--seed", "0",
                         "--uvicorn-log-level", "warning"),
                    out / f"pagedlm_serve_r{repeat}.log")
    try:
        _wait_healthy(url, server.proc, server.log)
        _serve_rates(args, "pagedlm", url, args.rates, repeat, out, [])
    finally:
        server.stop()


def _run_llama_server(args, repeat: int, out: Path) -> None:
    from pagedlm.loader.gguf_loader import default_model_path

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    ctx = args.slots * 2048  # llama-server splits -c between its slots
    server = Server([args.llama_server, "-m", str(default_model_path()), "--host",
                     "127.0.0.1", "--port", str(port), "-np", str(args.slots), "-c",
                     str(ctx), "-t", str(args.threads), "-tb", str(args.threads),
                     "--cont-batching", "--no-webui"],
                    out / f"llama_server_r{repeat}.log")
    try:
        _wait_healthy(url, server.proc, server.log)
        _serve_rates(args, "llama_server", url, args.rates, repeat, out,
                     ["--dtype", "gguf (llama.cpp kernels on the file's own types)"])
    finally:
        server.stop()


def _range(values: list[float]) -> dict:
    return {"min": min(values), "max": max(values), "median": statistics.median(values),
            "runs": values}


def summarize(out: Path, rates: list[str]) -> dict:
    """Ranges over the repeats, and the ratios the issue asks for."""
    offline = [next(iter(json.loads(p.read_text())["results"].values()))["output_tokens_per_s"]
               for p in sorted(out.glob("offline_r*.json"))]
    summary: dict = {"machine": json.loads(next(out.glob("offline_r*.json")).read_text())
                     .get("machine"), "offline_output_tok_s": _range(offline)}
    for name in ("pagedlm", "llama_server"):
        for rate in rates:
            runs = [json.loads(p.read_text())["results"]
                    for p in sorted(out.glob(f"{name}_rate{rate}_r*.json"))]
            if not runs:
                continue
            entry = {
                "output_tok_s": _range([r["output_throughput"] for r in runs]),
                "ttft_p50_ms": _range([r["ttft_ms"]["p50"] for r in runs]),
                "ttft_p99_ms": _range([r["ttft_ms"]["p99"] for r in runs]),
                "tpot_p50_ms": _range([r["tpot_ms"]["p50"] for r in runs]),
                "tpot_p99_ms": _range([r["tpot_ms"]["p99"] for r in runs]),
                "tpot_p99_over_p50": _range([r["tpot_ms"]["p99"] / r["tpot_ms"]["p50"]
                                             for r in runs]),
                "itl_p99_ms": _range([r["itl_ms"]["p99"] for r in runs]),
                "failed": sum(r["failed"] for r in runs),
            }
            if name == "pagedlm" and len(offline) == len(runs):
                entry["served_over_offline"] = _range(
                    [r["output_throughput"] / o for r, o in zip(runs, offline)])
            summary[f"{name}_rate{rate}"] = entry
        for rate in rates:
            ours, theirs = summary.get(f"pagedlm_rate{rate}"), summary.get(f"llama_server_rate{rate}")
            if ours and theirs:
                summary[f"pagedlm_over_llama_server_rate{rate}"] = (
                    ours["output_tok_s"]["median"] / theirs["output_tok_s"]["median"])
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--first-repeat", type=int, default=0,
                        help="number the runs from here (to add runs to an earlier set)")
    parser.add_argument("--engines", nargs="+", default=["pagedlm", "llama-server"],
                        choices=["pagedlm", "llama-server"],
                        help="pagedlm: offline and served runs; llama-server needs --llama-server")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--rates", nargs="+", default=["inf", "2", "4"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--llama-server", default=None,
                        help="llama-server binary (benchmarks/build_llama_cpp.sh builds one)")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--serve-flag", action="append", default=[],
                        help="extra engine flag for both the offline run and the server")
    parser.add_argument("--out", default="benchmarks/results/engine_core")
    parser.add_argument("--summarize-only", action="store_true")
    args = parser.parse_args()
    if "llama-server" in args.engines and not args.llama_server:
        args.engines.remove("llama-server")
    if args.summarize_only:
        print(json.dumps(summarize(Path(args.out), args.rates), indent=1))
        return
    run(args)


if __name__ == "__main__":
    main()
