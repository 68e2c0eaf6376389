"""The prefill of one long prompt by the size of a step: random prompts of 500, 1000 and 2000
tokens through the embedded SmolLM2 (q8 weights, float16 KV cache by default), one request
at a time, max_tokens 1, the prefix cache reset before each, the best of 4; each
--max-num-batched-tokens value in its own engine, the engines taking turns per prompt. With
--enforce-eager the Python layers compute every step (without it, steps of up to 512 tokens
go through the C++ decoder of Llama-family models).

    python benchmarks/cpu/prefill_chunks.py [--max-num-batched-tokens 2048 512 256]
        [--enforce-eager] [--weight-dtype q8 --kv-cache-dtype float16]
"""

import argparse
import random
import time

from pagedlm import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-num-batched-tokens", type=int, nargs="+", default=[2048, 512, 256])
    p.add_argument("--lengths", type=int, nargs="+", default=[500, 1000, 2000])
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--weight-dtype", default="q8")
    p.add_argument("--kv-cache-dtype", default="float16")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    engines = {n: LLM(weight_dtype=args.weight_dtype, kv_cache_dtype=args.kv_cache_dtype,
                      num_threads=args.num_threads, max_num_batched_tokens=n,
                      enforce_eager=args.enforce_eager)
               for n in args.max_num_batched_tokens}
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1)
    print(f"prefill ms (prompt tokens/s), best of {args.rounds}, by --max-num-batched-tokens"
          f"{' (Python layers)' if args.enforce_eager else ''}")
    for length in args.lengths:
        ids = [rng.randrange(100, 40000) for _ in range(length)]
        best = dict.fromkeys(engines, float("inf"))
        names = list(engines)
        for r in range(args.rounds + 1):  # the first round warms up
            for n in names[r % len(names):] + names[:r % len(names)]:
                engines[n].llm_engine.reset_prefix_cache()
                start = time.perf_counter()
                engines[n].generate({"prompt_token_ids": ids}, params, use_tqdm=False)
                if r:
                    best[n] = min(best[n], time.perf_counter() - start)
        print(f"{length:5d} tokens: " + "  ".join(
            f"{n}: {best[n] * 1e3:6.1f} ms ({length / best[n]:5.0f}/s)" for n in names), flush=True)


if __name__ == "__main__":
    main()
