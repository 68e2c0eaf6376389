"""Where the CPU goes while `pagedlm serve` is loaded: CPU-seconds of the server's frontend
process, its engine core process and the load client during one `pagedlm bench serving` run
(embedded SmolLM2, q8 weights, float16 KV cache, 64 ShareGPT requests at --request-rate,
EOS ignored), with the run's output tok/s and TPOT.

usage: python benchmarks/cpu/serving_cpu_split.py LABEL [--request-rate inf]
           [--frontend-nice N] [--client-nice N] [--env KEY=VALUE ...] [--out-dir DIR]
           [--serve-arg=--FLAG=VALUE ...]
(the run's JSON and the server's log go to DIR/cpu_split_LABEL.{json,log}; DIR defaults to
benchmarks/results/tmp/, which git ignores: the log holds this machine's paths)
(--frontend-nice sets PAGEDLM_FRONTEND_NICE for the server; --env sets any variable in the
server's environment, e.g. GOMP_SPINCOUNT=0; the client's figure covers its whole life,
dataset tokenisation included.) To compare two revisions, run it from each checkout, taking
turns.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import psutil


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _switches(proc: psutil.Process) -> tuple[int, int]:
    """Voluntary and involuntary context switches of every thread of `proc` (Linux keeps
    them per thread: psutil's figure is the main thread's alone)."""
    vol = invol = 0
    task_dir = f"/proc/{proc.pid}/task"
    for tid in os.listdir(task_dir):
        try:
            with open(f"{task_dir}/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        vol += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches:"):
                        invol += int(line.split()[1])
        except OSError:  # a thread that ended meanwhile
            pass
    return vol, invol


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("label")
    parser.add_argument("--request-rate", default="inf")
    parser.add_argument("--frontend-nice", type=int, default=None)
    parser.add_argument("--client-nice", type=int, default=0)
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "results", "tmp"))
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="an extra `pagedlm serve` argument (repeatable)")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    env = dict(os.environ)
    env.update(item.split("=", 1) for item in args.env)
    if args.frontend_nice is not None:
        env["PAGEDLM_FRONTEND_NICE"] = str(args.frontend_nice)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cli = [sys.executable, "-m", "pagedlm.entrypoints.cli"]
    log = open(os.path.join(args.out_dir, f"cpu_split_{args.label}.log"), "wb")
    server = subprocess.Popen([*cli, "serve", "--host", "127.0.0.1", "--port", str(port),
                               "--weight-dtype", "q8", "--kv-cache-dtype", "float16", "--seed", "0",
                               "--uvicorn-log-level", "warning", *args.serve_arg],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        for _ in range(1200):
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None:
                raise RuntimeError(f"the server exited; see {log.name}")
            time.sleep(0.5)
        frontend = psutil.Process(server.pid)
        core = next(c for c in frontend.children()
                    if any("spawn_main" in part for part in c.cmdline()))
        front0, core0 = _cpu_s(frontend), _cpu_s(core)
        switches0 = _switches(core)
        out = os.path.join(args.out_dir, f"cpu_split_{args.label}.json")
        start = time.time()
        client = subprocess.Popen(
            ["nice", "-n", str(args.client_nice), *cli, "bench", "serving", "--base-url", url,
             "--dataset", "sharegpt", "--num-prompts", "64", "--seed", "0", "--request-rate",
             args.request_rate, "--temperature", "1.0", "--top-p", "1.0", "--top-k", "0",
             "--min-p", "0.0", "--ignore-eos", "--disable-tqdm", "--output-json", out],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client_proc = psutil.Process(client.pid)
        client_s = 0.0
        while client.poll() is None:
            try:
                client_s = _cpu_s(client_proc)
            except psutil.Error:
                pass
            time.sleep(0.2)
        wall = time.time() - start
        front_s, core_s = _cpu_s(frontend) - front0, _cpu_s(core) - core0
        switches = _switches(core)  # its main thread and its compute threads
        voluntary, involuntary = switches[0] - switches0[0], switches[1] - switches0[1]
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(30)
        log.close()
    r = json.load(open(out))["results"]
    tokens = r["total_output_tokens"]
    run_client = r.get("client_cpu_s")  # the client's own figure for the run alone
    client_run = (f", client during the run {run_client:.2f} ({1e6 * run_client / tokens:.0f} "
                  f"us/token)" if run_client is not None else "")
    print(f"{args.label}: {r['output_throughput']:.1f} output tok/s, TPOT p50/p99 "
          f"{r['tpot_ms']['p50']:.1f}/{r['tpot_ms']['p99']:.1f} ms; {wall:.1f} s, CPU-s: "
          f"frontend {front_s:.2f} ({1e6 * front_s / tokens:.0f} us/token), core {core_s:.1f}, "
          f"client >= {client_s:.1f}{client_run}; core context switches {voluntary} voluntary, "
          f"{involuntary} involuntary")


if __name__ == "__main__":
    main()
