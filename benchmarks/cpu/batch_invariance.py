"""Do greedy outputs depend on what else is in the batch? The same repeating ShareGPT turns
(as `bench spec-decode` picks them), greedy, EOS ignored, on the embedded SmolLM2: each
alone, then all in one batch; counts the requests whose tokens part, and where.

usage: python benchmarks/cpu/batch_invariance.py [--num-prompts 8] [--max-tokens 128]
           [--weight-dtype q8] [--kv-cache-dtype float16]
"""

from __future__ import annotations

import argparse

from pagedlm import LLM, SamplingParams
from pagedlm.benchmarks.datasets import load_sharegpt_records
from pagedlm.benchmarks.spec_decode import chat_ids, sample_repeating


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--weight-dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    args = p.parse_args()
    llm = LLM(weight_dtype=args.weight_dtype, kv_cache_dtype=args.kv_cache_dtype)
    tokenizer = llm.get_tokenizer()
    requests = sample_repeating(tokenizer, args.num_prompts, 0, args.max_tokens,
                                load_sharegpt_records())
    prompts = [{"prompt_token_ids": chat_ids(tokenizer, r.prompt)} for r in requests]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    alone = [llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
             for prompt in prompts]
    llm.llm_engine.reset_prefix_cache()
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    parted = [next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
              for a, b in zip(alone, batched) if a != b]
    print(f"weights {args.weight_dtype}, KV cache {args.kv_cache_dtype}: {len(parted)} of "
          f"{len(prompts)} requests part between alone and batched"
          + (f", at tokens {parted}" if parted else ""))


if __name__ == "__main__":
    main()
