"""Forward time by kind of step on the ShareGPT throughput run: decode-only steps (the C++
decoder on CPU), mixed steps (decodes next to prompt tokens: the eager path) and
prefill-only steps, with their counts, totals and medians.

    python benchmarks/cpu/step_kinds.py [--num-prompts 64]
                                        [--max-prefill-tokens-with-decodes N]

Same workload as step_host_time.py (`pagedlm bench throughput`'s ShareGPT requests, seed 0,
EOS ignored, q8 weights, a float16 KV cache, 2 threads). The bound is the offline LLM's
default (none) unless given: 64 is the CPU server's.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-prefill-tokens-with-decodes", type=int, default=None)
    args = p.parse_args()

    from pagedlm import LLM
    from pagedlm.benchmarks.datasets import sample_sharegpt
    from pagedlm.benchmarks.throughput import run_pagedlm

    llm = LLM(num_threads=2, weight_dtype="q8", kv_cache_dtype="float16",
              max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes)
    requests = sample_sharegpt(llm.get_tokenizer(), args.num_prompts, seed=0)
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    records: list[tuple[int, int, int, float]] = []  # decodes, prefills, tokens, seconds
    forward = runner._forward

    def timed(inputs):
        t0 = time.perf_counter()
        hidden = forward(inputs)
        m = inputs.meta
        records.append((m.num_decodes, m.num_prefills, m.num_tokens, time.perf_counter() - t0))
        return hidden
    runner._forward = timed
    generate = llm.generate

    def generate_afresh(*a, **k):  # keep only the timed (last) call
        records.clear()
        return generate(*a, **k)
    llm.generate = generate_afresh
    result = run_pagedlm(llm, requests, use_tqdm=False)
    print(f"bound {args.max_prefill_tokens_with_decodes or 'none'}: {len(records)} steps, "
          f"{result['output_tokens_per_s']:.1f} output tok/s")
    kinds = {"decode-only": [r for r in records if r[1] == 0],
             "mixed": [r for r in records if r[0] and r[1]],
             "prefill-only": [r for r in records if not r[0]]}
    for kind, rs in kinds.items():
        if rs:
            print(f"  {kind:12s} {len(rs):4d} steps, {sum(r[3] for r in rs):6.1f} s, median "
                  f"{1e3 * statistics.median(r[3] for r in rs):7.1f} ms, median tokens "
                  f"{statistics.median(r[2] for r in rs):g} (decodes "
                  f"{statistics.median(r[0] for r in rs):g})")


if __name__ == "__main__":
    main()
