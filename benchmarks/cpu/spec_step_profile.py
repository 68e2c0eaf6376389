"""What a speculative verification costs, part by part: the repeating turns of `pagedlm bench
spec-decode` (batch 1, greedy, chat template) through a speculating engine, every decode
step timed and bucketed by its rows (1: no drafts; k + 1: a verification of k drafts), with
the C++ decoder's time per part of the layers for each bucket ("outside": the LM head,
sampling and the step's host work), the bucket's mean context (tokens before the step's
first row) and the attention's rate in GFLOP/s (QK and PV of every query head, each row
against its context and the rows before it).

    python benchmarks/cpu/spec_step_profile.py [--num-prompts 16] [--seed 0]
        [--weight-dtype q8 --kv-cache-dtype float16] [--num-speculative-tokens 6]
"""

import argparse
import collections
import time

from pagedlm import LLM, SamplingParams
from pagedlm.benchmarks.cli import SPEC_DECODE_MAX_OUTPUT_LEN as MAX_OUTPUT_LEN
from pagedlm.benchmarks.datasets import load_sharegpt_records
from pagedlm.benchmarks.spec_decode import DEFAULT_SPEC, chat_ids, sample_repeating


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-speculative-tokens", type=int, default=DEFAULT_SPEC["num_speculative_tokens"])
    p.add_argument("--weight-dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args()

    llm = LLM(num_threads=args.num_threads, weight_dtype=args.weight_dtype,
              kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=False,
              speculative_config={**DEFAULT_SPEC, "num_speculative_tokens": args.num_speculative_tokens})
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    decoder = runner.cpu_decoder
    if decoder is None:
        raise SystemExit("the C++ decoder is off for this model or these options")
    decoder.decoder.set_profile(True)
    max_rows = args.num_speculative_tokens + 1
    seconds: dict[int, float] = collections.defaultdict(float)
    steps: collections.Counter[int] = collections.Counter()
    context: collections.Counter[int] = collections.Counter()
    parts: dict[tuple[int, str], float] = collections.defaultdict(float)
    last: dict[str, float] = {}
    execute = runner.execute_model

    def timed(sched):
        start = time.perf_counter()
        out = execute(sched)
        elapsed = time.perf_counter() - start
        rows = sum(sched.num_scheduled_tokens.values())
        now = dict(decoder.decoder.profile())
        if rows <= max_rows:  # a decode step (prompts are longer)
            seconds[rows] += elapsed
            steps[rows] += 1
            context[rows] += sum(sched.cached_reqs.num_computed_tokens)
            for name, value in now.items():
                parts[(rows, name)] += value - last.get(name, 0.0)
        last.clear()
        last.update(now)
        return out

    tokenizer = llm.get_tokenizer()
    requests = sample_repeating(tokenizer, args.num_prompts, args.seed, MAX_OUTPUT_LEN, load_sharegpt_records())
    llm.generate({"prompt_token_ids": chat_ids(tokenizer, requests[0].prompt)},
                 SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # first calls
    runner.execute_model = timed
    for r in requests:
        llm.generate({"prompt_token_ids": chat_ids(tokenizer, r.prompt)},
                     SamplingParams(temperature=0, max_tokens=r.output_len), use_tqdm=False)
    names = sorted({name for _, name in parts}, key=lambda n: -parts[(1, n)])
    config = llm.llm_engine.core.hf_config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    flop_per_key = 4 * heads * head_dim * config.num_hidden_layers  # QK and PV, every layer
    print(f"ms per decode step by rows ({args.num_prompts} repeating turns, weights "
          f"{args.weight_dtype}, KV cache {args.kv_cache_dtype})")
    print(f"{'rows':>4s} {'steps':>6s} {'step':>7s} " + " ".join(f"{n[:12]:>12s}" for n in names)
          + f" {'outside':>8s} {'context':>8s} {'attn GFLOP/s':>12s}")
    for rows in sorted(steps):
        n = steps[rows]
        inside = sum(parts[(rows, name)] for name in names)
        ctx = context[rows] / n
        keys = rows * ctx + rows * (rows + 1) / 2  # each row's context and the rows to its own
        attention = parts.get((rows, "attention"), 0.0) / n
        rate = f"{flop_per_key * keys / attention / 1e9:12.1f}" if attention else f"{'-':>12s}"
        print(f"{rows:4d} {n:6d} {1e3 * seconds[rows] / n:7.2f} "
              + " ".join(f"{1e3 * parts[(rows, name)] / n:12.2f}" for name in names)
              + f" {1e3 * (seconds[rows] - inside) / n:8.2f} {ctx:8.0f} {rate}")


if __name__ == "__main__":
    main()
