"""What a burst of another process's CPU costs a decode whose threads fill the cores, and
what the frontend's flag (engine/cpu_share.py) gives back.

An offline engine (the embedded SmolLM2, int8 weights, float16 KV cache, one thread per
usable core) decodes 64 prompts of 40 tokens for --output-len tokens each, three ways
taking turns, round after round:
  plain    alone;
  burst    beside a process that spins for --busy-ms, then sleeps --idle-ms, over and over
           (a stand-in for a server frontend's work after each engine step);
  flagged  the same process, raising the CPU-share flag while it spins and yielding once,
           as the frontend's event loop does (csrc/lite_tensor.h leaves it a core).
The burner's share of one core is busy / (busy + idle); on a machine whose every core
decodes, the least a burst can cost is that share divided by the cores.

    python benchmarks/cpu/cpu_share_burst.py [--rounds 6] [--busy-ms 5 --idle-ms 45]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BURNER = """
import mmap, os, sys, time
busy, idle, path = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3, sys.argv[3]
flag = None
if path:
    fd = os.open(path, os.O_RDWR)
    flag = mmap.mmap(fd, 1)
while True:
    if flag is not None:
        flag[0] = 1
        os.sched_yield()
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    if flag is not None:
        flag[0] = 0
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

    from pagedlm.engine.cpu_share import CpuShare

    share = CpuShare()
    os.environ.update(share.env)  # before the kernels' first call, which reads it
    os.environ["PAGEDLM_CPU_SHARE"] = "1"
    try:
        from pagedlm import LLM, SamplingParams
        from pagedlm.engine.cpu_share import keep_flag_if_used

        threads = len(os.sched_getaffinity(0))
        keep_flag_if_used(threads)
        llm = LLM(num_threads=threads, weight_dtype="q8", kv_cache_dtype="float16")
        prompts = [{"prompt_token_ids": list(range(100 + i, 140 + i))} for i in range(64)]
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)  # first calls
        flag_path = "/dev/shm" + share.env["PAGEDLM_CPU_SHARE_FLAG"]
        kinds = ["plain", "burst", "flagged"]
        runs: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(args.rounds):
            for kind in kinds[r % 3:] + kinds[:r % 3]:  # each goes first in turn
                burner = None
                if kind != "plain":
                    burner = subprocess.Popen([sys.executable, "-c", BURNER, str(args.busy_ms),
                                               str(args.idle_ms), flag_path if kind == "flagged" else ""])
                    time.sleep(0.3)
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                runs[kind].append(time.perf_counter() - start)
                if burner is not None:
                    burner.kill()
                    burner.wait()
                print(f"round {r} {kind:8s} {runs[kind][-1]:.2f} s", flush=True)
    finally:
        share.close()
    duty = args.busy_ms / (args.busy_ms + args.idle_ms)
    print(f"burner: {100 * duty:.0f}% of one core in {args.busy_ms:g} ms bursts; {threads} cores decode")
    result = {"threads": threads, "busy_ms": args.busy_ms, "idle_ms": args.idle_ms,
              "output_len": args.output_len, "seconds": runs}
    for kind in kinds[1:]:
        ratios = [b / a for a, b in zip(runs["plain"], runs[kind])]
        result[f"{kind}_over_plain"] = ratios
        print(f"{kind} / plain per round: {', '.join(f'{x:.3f}' for x in ratios)}; "
              f"median {statistics.median(ratios):.3f}")
    ratios = [b / a for a, b in zip(runs["burst"], runs["flagged"])]
    result["flagged_over_burst"] = ratios
    print(f"flagged / burst per round: {', '.join(f'{x:.3f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.3f}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
