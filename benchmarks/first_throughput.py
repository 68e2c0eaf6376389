"""First offline throughput figure: pagedlm vs HF transformers static batching.

Both engines get the same ShareGPT requests (sampled as vLLM's throughput benchmark
does) and the same SmolLM2-135M-Instruct Q4_1 GGUF, run in fp32 on CPU.  Only the
generation is timed, never the model loading (which is reported separately).

    python benchmarks/first_throughput.py --output results.json
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

if importlib.util.find_spec("pagedlm") is None:
    # Run from a source checkout without `pip install -e .`: use the repo's package.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedlm.benchmarks.datasets import (  # noqa: E402
    SHAREGPT_FILENAME,
    SampleRequest,
    sample_sharegpt,
)
from pagedlm.benchmarks.hf_baseline import (  # noqa: E402
    SMOLLM2_GGUF,
    load_hf_model,
    load_hf_tokenizer,
    run_hf_static,
)


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo, falling back to platform info."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(threads: int) -> dict[str, Any]:
    import transformers

    try:
        # Cores this process may use, which is what a container actually grants.
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    return {
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "usable_cores": usable,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "threads": threads,
    }


def throughput(
    elapsed: float, num_requests: int, prompt_tokens: int, output_tokens: int
) -> dict[str, float | int]:
    return {
        "elapsed_s": elapsed,
        "num_requests": num_requests,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": num_requests / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
    }


def run_pagedlm(requests: list[SampleRequest], threads: int) -> dict[str, Any]:
    """Run pagedlm offline on ``requests``; time ``generate`` only, count real tokens."""
    from pagedlm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM()  # no model: the embedded SmolLM2 GGUF
    load_s = time.perf_counter() - start
    # The engine may pick its own thread count while loading; hold both engines to the same.
    torch.set_num_threads(threads)

    prompts = [r.prompt for r in requests]
    params = [
        SamplingParams(temperature=1.0, top_p=1.0, max_tokens=r.output_len, ignore_eos=True)
        for r in requests
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start

    # Count what the engine actually produced rather than trusting max_tokens, so a
    # short-stopping engine cannot look faster than it is.
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(r.prompt_len for r in requests)
    result: dict[str, Any] = throughput(elapsed, len(requests), prompt_tokens, generated)
    result["requested_output_tokens"] = sum(r.output_len for r in requests)
    result["load_s"] = load_s
    # The engine's own prompt token count, when it reports one, checks the sampler's.
    engine_prompt = [getattr(o, "prompt_token_ids", None) for o in outputs]
    if all(p is not None for p in engine_prompt):
        result["engine_prompt_tokens"] = sum(len(p) for p in engine_prompt)
    del llm, outputs
    gc.collect()
    return result


def run_hf(requests: list[SampleRequest], tokenizer: Any, batch_size: int, threads: int) -> dict:
    model, load_s = load_hf_model(dtype=torch.float32)
    print(f"HF model loaded from GGUF in {load_s:.1f} s")
    result = run_hf_static(
        model, tokenizer, requests, max_batch_size=batch_size, num_threads=threads
    )
    result["load_s"] = load_s
    result["max_batch_size"] = batch_size
    del model
    gc.collect()
    return result


def print_table(results: dict[str, dict[str, Any]]) -> None:
    hf = results.get("hf")
    header = f"{'engine':<10} {'req/s':>8} {'out tok/s':>10} {'total tok/s':>12} {'vs HF':>7}"
    print()
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        ratio = (
            f"{r['output_tokens_per_s'] / hf['output_tokens_per_s']:.2f}x"
            if hf is not None
            else "-"
        )
        print(
            f"{name:<10} {r['requests_per_s']:>8.3f} {r['output_tokens_per_s']:>10.1f} "
            f"{r['total_tokens_per_s']:>12.1f} {ratio:>7}"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--skip-hf", action="store_true", help="run pagedlm only")
    parser.add_argument("--skip-pagedlm", action="store_true", help="run the HF baseline only")
    parser.add_argument("--output", type=Path, default=None, help="write results JSON here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    start = time.perf_counter()
    tokenizer = load_hf_tokenizer()
    requests = sample_sharegpt(tokenizer, args.num_requests, seed=args.seed)
    print(
        f"Sampled {len(requests)} ShareGPT requests in {time.perf_counter() - start:.1f} s: "
        f"{sum(r.prompt_len for r in requests)} prompt tokens, "
        f"{sum(r.output_len for r in requests)} output tokens"
    )

    results: dict[str, dict[str, Any]] = {}
    if not args.skip_pagedlm:
        results["pagedlm"] = run_pagedlm(requests, args.threads)
    if not args.skip_hf:
        results["hf"] = run_hf(requests, tokenizer, args.hf_batch_size, args.threads)
    if "pagedlm" in results and "hf" in results:
        for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
            results["pagedlm"][f"{key}_vs_hf"] = results["pagedlm"][key] / results["hf"][key]
    print_table(results)

    report = {
        "machine": machine_info(args.threads),
        "model": SMOLLM2_GGUF,
        "dtype": "float32",
        "dataset": SHAREGPT_FILENAME,
        "num_requests": len(requests),
        "prompt_tokens": sum(r.prompt_len for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
        "seed": args.seed,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "pagedlm_ignore_eos": True},
        "results": results,
    }
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"Wrote {args.output}")
    return report


if __name__ == "__main__":
    main()
