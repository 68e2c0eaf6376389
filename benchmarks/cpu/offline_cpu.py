"""CPU-seconds of an offline run: `pagedlm bench throughput`'s timed generate (64 ShareGPT
requests, seed 0, EOS ignored, embedded SmolLM2, q8 weights, float16 KV cache, 2 threads),
with the process's user + system CPU time over the same span. Beside serving_cpu_split.py's
figures for the server, it says how much of the machine the offline run keeps busy.

    python benchmarks/cpu/offline_cpu.py [--num-prompts 64] [--num-threads 2]
        [--max-prefill-tokens-with-decodes N]   (the server's bound; offline has none)
"""

import argparse
import resource
import time

from pagedlm import LLM
from pagedlm.benchmarks.datasets import sample_sharegpt
from pagedlm.benchmarks.throughput import run_pagedlm


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--max-prefill-tokens-with-decodes", type=int, default=None)
    args = p.parse_args()
    llm = LLM(num_threads=args.num_threads, weight_dtype="q8", kv_cache_dtype="float16",
              max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes)
    requests = sample_sharegpt(llm.get_tokenizer(), args.num_prompts, seed=0)
    generate, spans = llm.generate, []

    def timed(*a, **k):  # run_pagedlm's warm-up call, then the timed one: the last counts
        cpu, wall = _cpu_s(), time.perf_counter()
        out = generate(*a, **k)
        spans.append((time.perf_counter() - wall, _cpu_s() - cpu))
        return out

    llm.generate = timed
    r = run_pagedlm(llm, requests, use_tqdm=False)
    wall, cpu = spans[-1]
    print(f"{r['output_tokens_per_s']:.1f} output tok/s ({r['output_tokens']} tokens); the timed "
          f"generate: {wall:.1f} s, {cpu:.1f} CPU-s ({cpu / wall:.2f} cores busy)")


if __name__ == "__main__":
    main()
