"""Where a decode step's time goes with and without LoRA adapters: the C++ decoder's own
per-part timers (LlamaDecoder.set_profile) over the decode steps of 32 requests (40-token
prompts, 48 greedy tokens each) on the embedded SmolLM2, first all on the base model, then
spread over --num-adapters random adapters of rank --rank; ms per decode step per part.

usage: python benchmarks/cpu/lora_decode_profile.py [--weight-dtype q8] [--kv-cache-dtype float16]
           [--num-adapters 4] [--rank 16]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from pagedlm import LLM, LoRARequest, SamplingParams
from pagedlm.benchmarks.lora import write_random_adapter

NUM_REQUESTS, PROMPT_LEN, MAX_TOKENS = 32, 40, 48


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weight-dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args()
    llm = LLM(kv_cache_memory=1 << 30, enable_lora=True, max_loras=args.num_adapters,
              max_lora_rank=args.rank, weight_dtype=args.weight_dtype,
              kv_cache_dtype=args.kv_cache_dtype)
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    if runner.cpu_decoder is None:
        raise SystemExit("the C++ decoder is off for this model or build")
    decoder = runner.cpu_decoder.decoder
    prompts = [{"prompt_token_ids": [1 + i + j for j in range(PROMPT_LEN)]}
               for i in range(NUM_REQUESTS)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        loras = []
        for i in range(args.num_adapters):
            path = Path(tmp) / f"adapter-{i}"
            write_random_adapter(path, llm.llm_engine.core.hf_config, args.rank, i)
            loras.append(LoRARequest(f"adapter-{i}", i + 1, str(path)))
        llm.generate(prompts[:2], params, use_tqdm=False, lora_request=loras[:2])  # warm-up
        for name, lora in (("base", None),
                           ("lora", [loras[i % len(loras)] for i in range(NUM_REQUESTS)])):
            llm.llm_engine.reset_prefix_cache()
            decoder.set_profile(True)
            llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
            parts = {k: v * 1e3 / (MAX_TOKENS - 1) for k, v in decoder.profile()}
            print(f"{name}: {sum(parts.values()):.1f} ms per decode step: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
            decoder.set_profile(False)


if __name__ == "__main__":
    main()
