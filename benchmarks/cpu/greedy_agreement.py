"""How far the faster CPU settings move greedy outputs from the exact float32 ones, next to
how far llama.cpp (llama-cpp-python, same GGUF file) is from them: the first N prompts of the
ShareGPT benchmark sample (seed 0), fed as the same token ids, greedy, a fixed number of
tokens each with EOS ignored. For every pair of runs: prompts whose outputs are identical,
and the mean length of the common prefix.

    python benchmarks/cpu/greedy_agreement.py [--num-prompts 64] [--max-tokens 64] [--no-llama-cpp]
        [--runs float32,q8,float16,kv_float16,kv_fp8,kv_fp8_e5m2]

The kv_* runs change only the KV cache's storage: float16, or float8 (e4m3 / e5m2) with
per-layer scales calibrated at start.
"""

import argparse
import importlib.util

from pagedlm import LLM, SamplingParams
from pagedlm.benchmarks.datasets import sample_sharegpt

RUNS = {
    "float32": {},
    "q8": {"weight_dtype": "q8"},
    "float16": {"weight_dtype": "float16", "kv_cache_dtype": "float16"},
    "kv_float16": {"kv_cache_dtype": "float16"},
    "kv_fp8": {"kv_cache_dtype": "fp8"},
    "kv_fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def llama_cpp_greedy(path: str, prompts: list[list[int]], max_tokens: int, threads: int) -> list[list[int]]:
    from llama_cpp import Llama

    llama = Llama(path, n_ctx=2048, n_threads=threads, verbose=False)
    outputs = []
    for ids in prompts:
        out = []
        for token in llama.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(token)
            if len(out) == max_tokens:
                break
        outputs.append(out)
    return outputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama-cpp-python")
    p.add_argument("--runs", default="float32,q8,float16",
                   help=f"comma-separated, from {','.join(RUNS)}; the first is the reference")
    args = p.parse_args()
    runs = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        p.error(f"unknown run(s) {unknown}; choose from {list(RUNS)}")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    outputs: dict[str, list[list[int]]] = {}
    prompts: list[list[int]] = []
    model_path = None
    for name in runs:
        kwargs = RUNS[name]
        llm = LLM(num_threads=args.num_threads, **kwargs)
        if not prompts:
            tokenizer = llm.get_tokenizer()
            prompts = [tokenizer.encode(r.prompt) for r in sample_sharegpt(tokenizer, args.num_prompts, seed=0)]
            model_path = llm.llm_engine.model_path
        results = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        outputs[name] = [list(r.outputs[0].token_ids) for r in results]
        del llm
    if not args.no_llama_cpp and importlib.util.find_spec("llama_cpp") is not None:
        outputs["llama.cpp"] = llama_cpp_greedy(str(model_path), prompts, args.max_tokens, args.num_threads)
    print(f"{len(prompts)} prompts, {args.max_tokens} greedy tokens each")
    names = list(outputs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            prefixes = [common_prefix(x, y) for x, y in zip(outputs[a], outputs[b])]
            same = sum(n == args.max_tokens for n in prefixes)
            print(f"{a:>9} vs {b:<9}  identical {same:3d}/{len(prompts)}  "
                  f"mean common prefix {sum(prefixes) / len(prefixes):5.1f}")


if __name__ == "__main__":
    main()
