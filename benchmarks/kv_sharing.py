"""KV memory saved by block sharing, and the prefix cache on a chat-bot workload.

Measures on the embedded SmolLM2-135M-Instruct with ShareGPT prompts:
  1. n = 4 parallel samples: peak KV blocks in use with sharing (prompt computed once,
     blocks shared, copy-on-write) vs the same four samples as independent requests
     with nothing shared (prefix caching off).
  2. beam search, width 4: peak blocks in use vs the blocks the same beams would need if
     each held a private copy of its tokens.
  3. many requests sharing a long system prompt: prefix-cache hit rate and throughput
     with and without prefix caching, same requests, same run.

Usage: python benchmarks/kv_sharing.py [--num-prompts 16] [--output results.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pagedlm import LLM, BeamSearchParams, SamplingParams  # noqa: E402
from pagedlm.benchmarks.datasets import sample_sharegpt  # noqa: E402
from pagedlm.loader.gguf_loader import GGUFCheckpoint, default_model_path  # noqa: E402
from pagedlm.loader.tokenizer import gguf_tokenizer  # noqa: E402


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PeakBlocks:
    """Wraps engine.step to record the peak of blocks in use and of unshared blocks."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.peak_used = 0
        self.peak_unshared = 0
        self._step = engine.step
        engine.step = self.step

    def step(self):
        out = self._step()
        kv = self.engine.kv_cache_manager
        used = kv.num_blocks - kv.num_free_blocks
        unshared = sum(cdiv(r.num_computed_tokens, kv.block_size) for r in self.engine.scheduler.running)
        self.peak_used = max(self.peak_used, used)
        self.peak_unshared = max(self.peak_unshared, unshared)
        return out

    def close(self) -> None:
        self.engine.step = self._step


def parallel_sampling(prompts, max_tokens: int) -> dict:
    results = {}
    for shared in (True, False):
        llm = LLM(enable_prefix_caching=shared)
        meter = PeakBlocks(llm.llm_engine)
        if shared:
            params = [SamplingParams(n=4, temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True)
                      for i in range(len(prompts))]
            llm.generate(prompts, params, use_tqdm=False)
        else:
            params = [SamplingParams(temperature=1.0, seed=i * 4 + j, max_tokens=max_tokens, ignore_eos=True)
                      for i in range(len(prompts)) for j in range(4)]
            llm.generate([p for p in prompts for _ in range(4)], params, use_tqdm=False)
        meter.close()
        results["shared" if shared else "independent"] = meter.peak_used
    results["saving"] = 1 - results["shared"] / results["independent"]
    return results


def beam_search(prompts, max_tokens: int) -> dict:
    llm = LLM()
    meter = PeakBlocks(llm.llm_engine)
    llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=max_tokens, ignore_eos=True))
    meter.close()
    return {"shared": meter.peak_used, "private_copies": meter.peak_unshared,
            "saving": 1 - meter.peak_used / meter.peak_unshared}


def prefix_workload(tokenizer, questions, system_tokens: int, max_tokens: int) -> dict:
    words = ("You are a meticulous assistant for a large online store. Follow the policy: "
             "answer politely, cite the order number, never reveal internal notes. ") * 40
    ids = tokenizer(words).input_ids[:system_tokens]
    system = tokenizer.decode(ids)
    out = {}
    for caching in (False, True):
        llm = LLM(enable_prefix_caching=caching)
        prompts = [llm.apply_chat_template([{"role": "system", "content": system},
                                            {"role": "user", "content": q}]) for q in questions]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        stats = llm.stats()
        n_prompt = sum(len(o.prompt_token_ids) for o in outs)
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        out["on" if caching else "off"] = {
            "elapsed_s": elapsed, "prompt_tokens": n_prompt, "output_tokens": n_out,
            "total_tokens_per_s": (n_prompt + n_out) / elapsed, "requests_per_s": len(outs) / elapsed,
            "prefix_cache_queries": stats.prefix_cache_queries, "prefix_cache_hits": stats.prefix_cache_hits,
            "hit_rate": stats.prefix_cache_hit_rate,
            "texts": [o.outputs[0].text for o in outs],
        }
    out["same_outputs"] = out["on"].pop("texts") == out["off"].pop("texts")
    out["speedup"] = out["on"]["total_tokens_per_s"] / out["off"]["total_tokens_per_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-chat-requests", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--output", default="benchmarks/results/kv_sharing_cpu_smollm2.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    tokenizer = gguf_tokenizer(GGUFCheckpoint(default_model_path()))
    reqs = sample_sharegpt(tokenizer, args.num_prompts + args.num_chat_requests, seed=0)
    prompts = [r.prompt for r in reqs[: args.num_prompts]]
    questions = [tokenizer.decode(tokenizer(r.prompt).input_ids[:64]) for r in reqs[args.num_prompts:]]
    results = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized, fp32)",
        "dataset": f"ShareGPT V3, seed 0, {args.num_prompts} prompts, max_tokens {args.max_tokens}",
        "block_size": 16,
        "parallel_sampling_n4": parallel_sampling(prompts, args.max_tokens),
        "beam_search_w4": beam_search(prompts, args.max_tokens),
        "prefix_cache_chat": prefix_workload(tokenizer, questions, args.system_tokens, 32),
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
