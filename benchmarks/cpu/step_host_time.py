"""Host time per engine step on the ShareGPT throughput run: everything a step does besides
the model's forward pass, the LM head and the sampler's tensor work (scheduling, building
the step's inputs and sampling tensors, reading results back, updating requests,
detokenising).

    python benchmarks/cpu/step_host_time.py [--num-prompts 64] [--baseline-rev REV]
                                             [--repeats N]

With --baseline-rev, the same measurement runs first on a checkout of REV (a git worktree
under a temporary directory, imported in a child process), then on this tree, and the
ratio is printed: one run, same machine, same workload (`pagedlm bench throughput`'s 64
ShareGPT requests, seed 0, EOS ignored, q8 weights and a float16 KV cache, 2 threads).
With --repeats N the pair runs N times, taking turns (baseline, this tree, this tree,
baseline, ...: each in a fresh child process), and the ratio of the medians is printed
with every run: a VM's slow minutes then fall on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _runner(engine):
    """The model runner of an in-process engine, wherever this revision keeps it."""
    if hasattr(engine, "runner"):
        return engine.runner
    return engine.model_executor.driver_worker.model_runner


def measure(num_prompts: int) -> dict:
    from pagedlm import LLM
    from pagedlm.benchmarks.datasets import sample_sharegpt
    from pagedlm.benchmarks.throughput import run_pagedlm
    from pagedlm.sample.sampler import Sampler

    llm = LLM(num_threads=2, weight_dtype="q8", kv_cache_dtype="float16")
    requests = sample_sharegpt(llm.get_tokenizer(), num_prompts, seed=0)
    engine = llm.llm_engine
    runner = _runner(engine)
    device_s = [0.0]
    sampler_s = [0.0]
    step_s: list[float] = []

    def timed(fn, also=None):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                device_s[0] += time.perf_counter() - t0
                if also is not None:
                    also[0] += time.perf_counter() - t0
        return wrapper

    runner._forward = timed(runner._forward)
    runner.model.compute_logits = timed(runner.model.compute_logits)
    sampler_call = Sampler.__call__
    Sampler.__call__ = timed(sampler_call, sampler_s)
    step = engine.step

    def timed_step():
        t0 = time.perf_counter()
        out = step()
        step_s.append(time.perf_counter() - t0)
        return out

    engine.step = timed_step
    generate = llm.generate

    def generate_afresh(*args, **kw):  # keep only the timed (last) call's steps
        step_s.clear()
        device_s[0] = sampler_s[0] = 0.0
        return generate(*args, **kw)

    llm.generate = generate_afresh
    result = run_pagedlm(llm, requests, use_tqdm=False)
    Sampler.__call__ = sampler_call
    steps = [s for s in step_s if s > 0]
    total = sum(steps)
    host = total - device_s[0]
    return {
        "num_steps": len(steps),
        "step_s": total,
        "device_s": device_s[0],
        "host_s": host,
        "host_ms_per_step": 1e3 * host / max(1, len(steps)),
        "sampler_ms_per_step": 1e3 * sampler_s[0] / max(1, len(steps)),
        "output_tokens_per_s": result["output_tokens_per_s"],
    }


def _print(tag: str, r: dict) -> None:
    print(f"{tag}: {r['num_steps']} steps, {r['step_s']:.2f} s in steps, model+LM head+sampler "
          f"{r['device_s']:.2f} s (sampler {r['sampler_ms_per_step']:.3f} ms/step), "
          f"host {r['host_s']:.2f} s = {r['host_ms_per_step']:.3f} ms/step; "
          f"{r['output_tokens_per_s']:.1f} output tok/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--baseline-rev", help="measure this git revision first, then this tree")
    p.add_argument("--repeats", type=int, default=1,
                   help="with --baseline-rev: pairs of runs, taking turns (default 1)")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # child process mode
    args = p.parse_args()
    if args.json:
        print(json.dumps(measure(args.num_prompts)))
        return
    if not args.baseline_rev:
        _print("this tree", measure(args.num_prompts))
        return
    repo = subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip()
    runs: dict[str, list[dict]] = {"baseline": [], "this tree": []}
    with tempfile.TemporaryDirectory() as tmp:
        tree = os.path.join(tmp, "baseline")
        subprocess.check_call(["git", "-C", repo, "worktree", "add", "--detach", tree,
                               args.baseline_rev], stdout=subprocess.DEVNULL)
        try:
            for i in range(args.repeats):
                order = ["baseline", "this tree"] if i % 2 == 0 else ["this tree", "baseline"]
                for which in order:
                    root = tree if which == "baseline" else repo
                    r = _measure_in_child(root, args.num_prompts)
                    runs[which].append(r)
                    tag = f"baseline {args.baseline_rev}" if which == "baseline" else which
                    _print(f"run {i + 1}, {tag}", r)
        finally:
            subprocess.call(["git", "-C", repo, "worktree", "remove", "--force", tree])
    base = statistics.median(r["host_ms_per_step"] for r in runs["baseline"])
    new = statistics.median(r["host_ms_per_step"] for r in runs["this tree"])
    tput = (statistics.median(r["output_tokens_per_s"] for r in runs["this tree"])
            / statistics.median(r["output_tokens_per_s"] for r in runs["baseline"]))
    ratios = [n["host_ms_per_step"] / b["host_ms_per_step"]
              for b, n in zip(runs["baseline"], runs["this tree"])]
    samplers = [statistics.median(r["sampler_ms_per_step"] for r in runs[w])
                for w in ("baseline", "this tree")]
    print(f"sampler per step, medians: baseline {samplers[0]:.3f} ms, this tree "
          f"{samplers[1]:.3f} ms")
    print(f"host time per step, medians over {args.repeats} run(s): baseline {base:.3f} ms, "
          f"this tree {new:.3f} ms = {new / base:.2f}x the baseline "
          f"({100 * (1 - new / base):.0f}% lower); per pair "
          f"{', '.join(f'{r:.2f}' for r in ratios)}; throughput {tput:.2f}x")


def _measure_in_child(root: str, num_prompts: int) -> dict:
    """`measure` in a child process that imports pagedlm from `root`."""
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.check_output(
        [sys.executable, os.path.abspath(__file__), "--json", "--num-prompts", str(num_prompts)],
        env=env, cwd=root, text=True)
    return json.loads(out.strip().splitlines()[-1])

if __name__ == "__main__":
    main()
