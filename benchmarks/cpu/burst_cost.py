"""What short bursts of another process's CPU cost a decode whose threads fill the cores:
the server's frontend and a load client on the same machine, in a controlled form.

An offline engine (the embedded SmolLM2, int8 weights, float16 KV cache, one thread per
usable core) decodes 64 prompts of 40 tokens for --output-len tokens each, two ways taking
turns, round after round:
  plain    alone;
  burst    beside a process that spins for --busy-ms, then sleeps --idle-ms, over and over
           (as a frontend works after each engine step).
The burner takes busy / (busy + idle) of one core, so the least it can cost a decode that
fills every core is that share divided by the cores. It costs more: the thread whose core
it takes holds its part of the kernel it is in, and the other threads wait for it at the
kernel's end.

    python benchmarks/cpu/burst_cost.py [--rounds 6] [--busy-ms 5 --idle-ms 45]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import psutil

BURNER = """
import sys, time
busy, idle = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(idle)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--busy-ms", type=float, default=5.0)
    p.add_argument("--idle-ms", type=float, default=45.0)
    p.add_argument("--output-len", type=int, default=160)
    p.add_argument("--out", help="write the runs here as JSON")
    args = p.parse_args()

    from pagedlm import LLM, SamplingParams

    threads = len(os.sched_getaffinity(0))
    llm = LLM(num_threads=threads, weight_dtype="q8", kv_cache_dtype="float16")
    prompts = [{"prompt_token_ids": list(range(100 + i, 140 + i))} for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)  # first calls
    kinds = ["plain", "burst"]
    runs: dict[str, list[float]] = {k: [] for k in kinds}
    burner_cpu: list[float] = []
    for r in range(args.rounds):
        for kind in kinds[r % 2:] + kinds[:r % 2]:  # each goes first in turn
            burner = None
            if kind == "burst":
                burner = subprocess.Popen([sys.executable, "-c", BURNER, str(args.busy_ms),
                                           str(args.idle_ms)])
                time.sleep(0.3)
                cpu0 = _cpu_seconds(burner.pid)
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            runs[kind].append(seconds)
            if burner is not None:
                burner_cpu.append((_cpu_seconds(burner.pid) - cpu0) / seconds)
                burner.kill()
                burner.wait()
            print(f"round {r} {kind:6s} {seconds:.2f} s", flush=True)
    ratios = [b / a for a, b in zip(runs["plain"], runs["burst"])]
    share = statistics.median(burner_cpu)
    print(f"{threads} threads decode; the burner took {100 * share:.1f}% of one core "
          f"({args.busy_ms:g} ms bursts), {100 * share / threads:.1f}% of the machine")
    print(f"burst / plain per round: {', '.join(f'{x:.3f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.3f}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"threads": threads, "busy_ms": args.busy_ms, "idle_ms": args.idle_ms,
                       "output_len": args.output_len, "seconds": runs,
                       "burner_share_of_one_core": burner_cpu, "burst_over_plain": ratios},
                      f, indent=1)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


if __name__ == "__main__":
    main()
