"""Host time per engine step on the ShareGPT throughput run: everything a step does besides
the model's forward pass, the LM head and the sampler's tensor work (scheduling, building
the step's inputs and sampling tensors, reading results back, updating requests,
detokenising).

    python benchmarks/cpu/step_host_time.py [--num-prompts 64] [--baseline-rev REV]

With --baseline-rev, the same measurement runs first on a checkout of REV (a git worktree
under a temporary directory, imported in a child process), then on this tree, and the
ratio is printed: one run, same machine, same workload (`pagedlm bench throughput`'s 64
ShareGPT requests, seed 0, EOS ignored, q8 weights and a float16 KV cache, 2 threads).
"""

from __future__ import annotations

import argparse
import json
import os
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
    step_s: list[float] = []

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                device_s[0] += time.perf_counter() - t0
        return wrapper

    runner._forward = timed(runner._forward)
    runner.model.compute_logits = timed(runner.model.compute_logits)
    sampler_call = Sampler.__call__
    Sampler.__call__ = timed(sampler_call)
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
        device_s[0] = 0.0
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
        "output_tokens_per_s": result["output_tokens_per_s"],
    }


def _print(tag: str, r: dict) -> None:
    print(f"{tag}: {r['num_steps']} steps, {r['step_s']:.2f} s in steps, model+LM head+sampler "
          f"{r['device_s']:.2f} s, host {r['host_s']:.2f} s = {r['host_ms_per_step']:.3f} ms/step; "
          f"{r['output_tokens_per_s']:.1f} output tok/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--baseline-rev", help="measure this git revision first, then this tree")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # child process mode
    args = p.parse_args()
    if args.json:
        print(json.dumps(measure(args.num_prompts)))
        return
    if args.baseline_rev:
        repo = subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip()
        with tempfile.TemporaryDirectory() as tmp:
            tree = os.path.join(tmp, "baseline")
            subprocess.check_call(["git", "-C", repo, "worktree", "add", "--detach", tree,
                                   args.baseline_rev], stdout=subprocess.DEVNULL)
            try:
                env = dict(os.environ, PYTHONPATH=tree)
                out = subprocess.check_output(
                    [sys.executable, os.path.abspath(__file__), "--json",
                     "--num-prompts", str(args.num_prompts)], env=env, cwd=tree, text=True)
                base = json.loads(out.strip().splitlines()[-1])
            finally:
                subprocess.call(["git", "-C", repo, "worktree", "remove", "--force", tree])
        _print(f"baseline {args.baseline_rev}", base)
    new = measure(args.num_prompts)
    _print("this tree", new)
    if args.baseline_rev:
        print(f"host time per step: {new['host_ms_per_step'] / base['host_ms_per_step']:.2f}x "
              f"the baseline ({100 * (1 - new['host_ms_per_step'] / base['host_ms_per_step']):.0f}% "
              f"lower); throughput {new['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
