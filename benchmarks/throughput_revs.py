"""`pagedlm bench throughput` at two git revisions, run alternately on the same machine.

For changes that must not move the speed (a refactor): the revision under test is checked
out in a temporary git worktree, and each pair runs the baseline and the current tree one
after the other with the same flags, so drift of a noisy machine falls on both. Prints each
run and the median ratio current / baseline of output tokens per second.

    python benchmarks/throughput_revs.py --base a0d6380 --pairs 3 -- \\
        --weight-dtype q8 --kv-cache-dtype float16 --num-prompts 64

Everything after `--` goes to `pagedlm bench throughput` in both trees. The two trees build
their C++ kernels separately (a kernel's source hash names its build), so the first pair
includes no build time only if each tree has run once before: pass --warmup 1 to run each
once untimed first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_bench(tree: Path, bench_args: list[str], out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "pagedlm.entrypoints.cli", "bench", "throughput",
           *bench_args, "--output-json", str(out)]
    done = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed in {tree}:\n{done.stderr[-4000:]}")
    report = json.loads(out.read_text())
    return next(iter(report["results"].values()))  # one backend: pagedlm


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="the baseline git revision")
    p.add_argument("--pairs", type=int, default=3, help="baseline/current runs, alternating")
    p.add_argument("--warmup", type=int, default=0, help="untimed runs of each tree first")
    p.add_argument("bench_args", nargs=argparse.REMAINDER,
                   help="-- then the flags for `pagedlm bench throughput`")
    args = p.parse_args()
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base_tree),
                        args.base], check=True, capture_output=True)
        try:
            trees = {"base": base_tree, "current": REPO}
            for _ in range(args.warmup):
                for name, tree in trees.items():
                    run_bench(tree, bench_args, Path(tmp) / f"warmup-{name}.json")
            rates: dict[str, list[float]] = {"base": [], "current": []}
            for i in range(args.pairs):
                for name, tree in trees.items():
                    r = run_bench(tree, bench_args, Path(tmp) / f"{name}-{i}.json")
                    rates[name].append(r["output_tokens_per_s"])
                    print(f"pair {i + 1} {name:8s} {r['output_tokens_per_s']:8.1f} output tok/s",
                          flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                            str(base_tree)], check=False, capture_output=True)
    ratios = [c / b for b, c in zip(rates["base"], rates["current"])]
    print(f"current / base ({args.base}): median {statistics.median(ratios):.3f}, "
          f"range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
