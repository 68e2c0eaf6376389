"""Where the server's frontend process spends its time while `pagedlm serve` is loaded: py-spy
samples the frontend (not the engine core's process) during one `pagedlm bench serving` run
(embedded SmolLM2, q8 weights, float16 KV cache, 64 ShareGPT requests at rate inf, EOS
ignored), then prints the functions most often on top of the stack and most often anywhere
in it. py-spy's own sampling costs CPU too, so the run's tok/s is lower than unprofiled;
samples of a thread waiting for the GIL count as that thread's.

    python benchmarks/cpu/frontend_profile.py [--rate 250] [--top 25] [--gil] [--perf]
    (needs py-spy; --perf also needs Linux perf)

py-spy counts a thread that is runnable but waiting for a core as busy, so on a loaded
machine its samples are wall time, not CPU: `--gil` keeps only samples of the thread
holding the GIL, and `--perf` also runs `perf record` on the frontend, which samples CPU
only, and prints the share of each library (the interpreter, the kernel, pydantic-core,
the tokenizer...).
"""

import argparse
import collections
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--gil", action="store_true", help="only samples of the thread holding the GIL")
    p.add_argument("--perf", action="store_true", help="also `perf record` the frontend's CPU")
    args = p.parse_args()
    cli = [sys.executable, "-m", "pagedlm.entrypoints.cli"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "frontend.raw"
        server = subprocess.Popen([*cli, "serve", "--host", "127.0.0.1", "--port", str(port),
                                   "--weight-dtype", "q8", "--kv-cache-dtype", "float16",
                                   "--num-threads", "2"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            for _ in range(300):
                try:
                    urllib.request.urlopen(f"{url}/health", timeout=1)
                    break
                except OSError:
                    time.sleep(0.5)
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(server.pid), "--rate", str(args.rate),
                                    "--nonblocking", "--format", "raw", "-o", str(raw),
                                    *(["--gil"] if args.gil else [])],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            perf_data = Path(tmp) / "perf.data"
            perf = subprocess.Popen(["perf", "record", "-F", "997", "-p", str(server.pid), "-o",
                                     str(perf_data)], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL) if args.perf else None
            time.sleep(1)
            bench = subprocess.run([*cli, "bench", "serving", "--base-url", url, "--dataset", "sharegpt",
                                    "--num-prompts", "64", "--request-rate", "inf", "--temperature", "1.0",
                                    "--top-p", "1.0", "--ignore-eos"], capture_output=True, text=True)
            print("".join(line + "\n" for line in bench.stdout.splitlines() if "Output token throughput" in line))
            spy.send_signal(2)
            spy.wait(30)
            if perf is not None:
                perf.send_signal(2)
                perf.wait(30)
        finally:
            server.send_signal(2)
            server.wait(30)
        top: collections.Counter[str] = collections.Counter()
        anywhere: collections.Counter[str] = collections.Counter()
        total = 0
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack:
                continue
            n, frames = int(count), stack.split(";")
            total += n
            top[frames[-1]] += n
            for frame in set(frames):
                anywhere[frame] += n
        perf_report = subprocess.run(
            ["perf", "report", "-i", str(perf_data), "--stdio", "--sort", "dso", "-g", "none"],
            capture_output=True, text=True).stdout if args.perf else ""
    print(f"{total} samples of the frontend process; on top of the stack:")
    for frame, n in top.most_common(args.top):
        print(f"  {n:6d} {100 * n / total:5.1f}%  {frame}")
    print("anywhere in the stack:")
    for frame, n in anywhere.most_common(args.top):
        print(f"  {n:6d} {100 * n / total:5.1f}%  {frame}")
    if args.perf:
        print("perf, the frontend's CPU by library:")
        print("".join(f"  {line.strip()}\n" for line in perf_report.splitlines()
                      if line.strip() and not line.startswith("#")), end="")


if __name__ == "__main__":
    main()
