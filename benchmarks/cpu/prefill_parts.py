"""Where one long prompt's prefill goes, by part of the layers: a prompt of --tokens random
token ids (seed 0) through the engine (int8 weights, float16 KV cache by default, the
engine's 512-token CPU steps), max_tokens 1, the C++ decoder's profile per part, --repeats
times after one warm-up.

    python benchmarks/cpu/prefill_parts.py [--tokens 1000] [--repeats 3]
"""

import argparse
import time

import torch

from pagedlm import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--weight-dtype", default="q8")
    p.add_argument("--kv-cache-dtype", default="float16")
    args = p.parse_args()
    llm = LLM(num_threads=2, weight_dtype=args.weight_dtype, kv_cache_dtype=args.kv_cache_dtype,
              enable_prefix_caching=False)
    decoder = llm.llm_engine.core.model_executor.driver_worker.model_runner.cpu_decoder
    if decoder is None:
        raise SystemExit("the C++ decoder is off for this model or these options")
    decoder.decoder.set_profile(True)
    ids = torch.randint(100, 40000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)  # first calls
    for _ in range(args.repeats):
        before = dict(decoder.decoder.profile())
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        parts = {k: v - before.get(k, 0.0) for k, v in decoder.decoder.profile()}
        print(f"{args.tokens}-token prefill {elapsed * 1e3:.0f} ms; layers {sum(parts.values()) * 1e3:.0f} ms: "
              + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
