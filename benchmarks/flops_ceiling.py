"""How close a throughput run comes to this machine's matmul ceiling.

Measures torch's float32 GEMM rate (GFLOP/s) on the model's own projection shapes at
a large row count, with the thread count the run used, and divides the model FLOPs a
`pagedlm bench throughput` result implies by its elapsed time:

    FLOPs = 2 * (non-embedding linear params) * (prompt + output tokens)
          + 2 * (LM-head params) * (output tokens)               (logits only where sampled)
          + attention: 4 * num_heads * head_dim * layers * (sum of contexts attended)

    python benchmarks/flops_ceiling.py benchmarks/results/<throughput>.json [--threads 2]

The attention term is estimated from the totals (each output token attends to the mean
context); it is a few percent of the total for short-context workloads like ShareGPT.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def gemm_gflops(m: int, k: int, n: int, seconds: float = 1.0) -> float:
    x, w = torch.randn(m, k), torch.randn(n, k)
    torch.nn.functional.linear(x, w)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.nn.functional.linear(x, w)
        count += 1
    return 2 * m * k * n * count / (time.perf_counter() - start) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result_json")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--label", default="pagedlm", help="which engine of the JSON's results")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from pagedlm.loader.model_loader import resolve_model_source

    with open(args.result_json) as f:
        data = json.load(f)
    results = data["results"]
    run = next(r for r in results if r.get("backend", r.get("label")) == args.label) \
        if isinstance(results, list) else results[args.label]
    cfg = resolve_model_source(None).hf_config
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = h // heads
    linear = layers * (h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * inter)
    head = cfg.vocab_size * h
    prompt, output = run["prompt_tokens"], run["output_tokens"]
    n = run["num_requests"]
    mean_ctx = (prompt + output / 2) / n  # mean context of an output token, roughly
    attention = 4 * heads * d * layers * (prompt * prompt / n / 2 + output * mean_ctx)
    flops = 2 * linear * (prompt + output) + 2 * head * output + attention
    elapsed = run["elapsed_s"]

    shapes = [(1024, h, inter * 2), (1024, inter, h), (1024, h, (heads + 2 * kv_heads) * d)]
    rates = {f"{m}x{k}x{nn}": round(gemm_gflops(m, k, nn), 1) for m, k, nn in shapes}
    ceiling = max(rates.values())
    achieved = flops / elapsed / 1e9
    print(json.dumps({
        "threads": args.threads, "gemm_gflops_fp32": rates, "ceiling_gflops": ceiling,
        "model_tflop": round(flops / 1e12, 3), "elapsed_s": elapsed,
        "achieved_gflops": round(achieved, 1), "fraction_of_ceiling": round(achieved / ceiling, 3),
    }, indent=1))


if __name__ == "__main__":
    main()
