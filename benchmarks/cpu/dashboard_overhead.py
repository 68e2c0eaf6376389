"""What an open dashboard costs the engine: `pagedlm serve` (embedded SmolLM2, q8 weights,
float16 KV cache) under `pagedlm bench serving` (ShareGPT, --request-rate inf, EOS
ignored), runs without and with a dashboard open, interleaved, on one server.

A dashboard is an SSE client of /dashboard/events that decodes every event as the page
does. For each run with one open, the engine's own accounting (`build_seconds_total` and
`step_seconds_total` of /dashboard/state, read before and after) gives the time spent
building snapshots over the time spent stepping; the runs' output tok/s give the
end-to-end ratio (the frontend's encoding and sending included).

usage: python benchmarks/cpu/dashboard_overhead.py [--num-prompts 64] [--pairs 2]
           [--out benchmarks/results/dashboard/overhead_cpu_smollm2.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path


def _state(url: str) -> dict:
    with urllib.request.urlopen(url + "/dashboard/state", timeout=60) as r:
        return json.load(r)["snapshot"]


class Watcher(threading.Thread):
    """A dashboard page: reads /dashboard/events and decodes every event."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.events, self.snapshots = url, threading.Event(), 0, 0

    def run(self) -> None:
        with urllib.request.urlopen(self.url + "/dashboard/events", timeout=60) as r:
            for raw in r:
                line = raw.decode()
                if line.startswith("data: "):
                    data = json.loads(line[6:])
                    self.events += 1
                    self.snapshots += bool(data.get("snapshot"))
                if self.stop.is_set():
                    return


def bench(url: str, num_prompts: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "pagedlm.entrypoints.cli", "bench", "serving", "--base-url", url,
           "--dataset", "sharegpt", "--num-prompts", str(num_prompts), "--request-rate", "inf",
           "--ignore-eos", "--seed", "0", "--disable-tqdm", "--output-json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["results"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/dashboard/overhead_cpu_smollm2.json")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    tmp = Path(tempfile.mkdtemp())
    server_cmd = [sys.executable, "-m", "pagedlm.entrypoints.cli", "serve", "--host",
                  "127.0.0.1", "--port", str(port), "--weight-dtype", "q8",
                  "--kv-cache-dtype", "float16", "--seed", "0", "--uvicorn-log-level", "warning"]
    log = open(tmp / "server.log", "wb")
    server = subprocess.Popen(server_cmd, stdout=log, stderr=subprocess.STDOUT,
                              env=dict(os.environ))
    runs = []
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit((tmp / "server.log").read_text()) from None
                time.sleep(0.5)
        # A whole run first, measured by nobody: the first after start is slower.
        bench(url, args.num_prompts, tmp / "warmup.json")
        for i in range(2 * args.pairs):
            open_dashboard = i % 2 == 1
            before = _state(url)
            watcher = Watcher(url) if open_dashboard else None
            if watcher:
                watcher.start()
                time.sleep(0.5)
            result = bench(url, args.num_prompts, tmp / f"run{i}.json")
            if watcher:
                watcher.stop.set()
            after = _state(url)
            build = after["build_seconds_total"] - before["build_seconds_total"]
            step = after["step_seconds_total"] - before["step_seconds_total"]
            run = {"dashboard_open": open_dashboard,
                   "output_tokens_per_s": result["output_throughput"],
                   "median_tpot_ms": result["tpot_ms"]["median"],
                   "p99_tpot_ms": result["tpot_ms"]["p99"],
                   "snapshots_built": after["num_snapshots"] - before["num_snapshots"] - 1,
                   "snapshot_seconds": build, "step_seconds": step,
                   "snapshot_share_of_step_time": build / step if step else None}
            if watcher:
                run["events_received"] = watcher.events
                run["events_with_snapshot"] = watcher.snapshots
                run["run_seconds"] = result["duration_s"]
            runs.append(run)
            print(json.dumps(run))
    finally:
        server.terminate()
        server.wait(30)
    plain = [r["output_tokens_per_s"] for r in runs if not r["dashboard_open"]]
    watched = [r for r in runs if r["dashboard_open"]]
    summary = {
        "machine": "2-core x86-64 VM (AVX-512), torch 2.13.0+cpu",
        "model": "embedded SmolLM2-135M-Instruct (Q4_1 GGUF), --weight-dtype q8 "
                 "--kv-cache-dtype float16",
        "dataset": f"ShareGPT V3, {args.num_prompts} requests, request rate inf, EOS ignored",
        "command": "python benchmarks/cpu/dashboard_overhead.py " + " ".join(sys.argv[1:]),
        "runs": runs,
        "snapshot_share_of_step_time": sum(r["snapshot_seconds"] for r in watched)
        / sum(r["step_seconds"] for r in watched),
        "throughput_ratio_open_vs_closed": (sum(r["output_tokens_per_s"] for r in watched)
                                            / len(watched)) / (sum(plain) / len(plain)),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
