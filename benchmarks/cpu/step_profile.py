"""Where a throughput run's time goes, step by step: the ShareGPT workload of
`pagedlm bench throughput` (64 requests, seed 0, EOS ignored, float16 weights and KV cache
by default), with every engine step timed and bucketed by what it computed (pure decode
steps by their number of rows; steps that also prefill), and where the C++ decoder runs
(--q8: decode steps and steps of up to 512 tokens), its time per part of the layers.

    python benchmarks/cpu/step_profile.py [--num-prompts 64] [--float32 | --q8]

For the time per Python line (C++ kernels show as the line calling them), run it under
py-spy and summarise the raw samples:

    py-spy record -r 40 -f raw -o /tmp/steps.txt -- python benchmarks/cpu/step_profile.py
    python benchmarks/cpu/step_profile.py --summarize /tmp/steps.txt
"""

import argparse
import collections
import re
import time


def summarize(path: str, top: int = 30) -> None:
    """Leaf frames of the samples taken inside engine steps, as a share of them."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if "LLMEngine.step" not in stack:
                continue
            frames = stack.split(";")
            # A torch op's own frames name no caller: show the line that called into torch.
            k = len(frames) - 1
            while k > 0 and re.search(r"\((?:.*/)?torch/", frames[k]):
                k -= 1
            leaf = frames[k] + (" -> torch" if k < len(frames) - 1 else "")
            leaf = re.sub(r" \(.*?([^/]+\.py):(\d+)\)", r" (\1:\2)", leaf)
            counts[leaf] += int(n)
            total += int(n)
    print(f"{total} samples inside engine steps")
    for leaf, n in counts.most_common(top):
        print(f"{100 * n / total:5.1f}%  {leaf}")


def profile(num_prompts: int, float32: bool, q8: bool = False) -> None:
    from pagedlm import LLM
    from pagedlm.benchmarks.datasets import sample_sharegpt
    from pagedlm.benchmarks.throughput import run_pagedlm

    kwargs = {} if float32 else {"weight_dtype": "q8" if q8 else "float16", "kv_cache_dtype": "float16"}
    llm = LLM(num_threads=2, **kwargs)
    requests = sample_sharegpt(llm.get_tokenizer(), num_prompts, seed=0)
    engine = llm.llm_engine

    steps: list[tuple[int, int, float]] = []  # (decode rows, prefill tokens, seconds)
    execute, generate = engine.model_executor.driver_worker.model_runner.execute_model, llm.generate

    def timed(sched):
        start = time.perf_counter()
        out = execute(sched)
        decodes = sum(1 for n in sched.num_scheduled_tokens.values() if n == 1)
        prefill = sum(n for n in sched.num_scheduled_tokens.values() if n != 1)
        steps.append((decodes, prefill, time.perf_counter() - start))
        return out

    def generate_afresh(*args, **kw):  # keeps only the steps of the last (timed) call
        steps.clear()
        return generate(*args, **kw)

    engine.model_executor.driver_worker.model_runner.execute_model, llm.generate = timed, generate_afresh
    decoder = engine.model_executor.driver_worker.model_runner.cpu_decoder  # the C++ decoder, if on
    if decoder is not None:
        original_generate = llm.generate

        def generate_profiled(*args, **kw):  # its per-part times of the last call only
            decoder.decoder.set_profile(True)
            return original_generate(*args, **kw)

        llm.generate = generate_profiled
    # The very run of `pagedlm bench throughput`: warm-up, then every request at once.
    result = run_pagedlm(llm, requests, use_tqdm=False)
    model_s = sum(s[2] for s in steps)
    print(f"{num_prompts} requests: {result['elapsed_s']:.1f} s, {result['output_tokens']} output "
          f"tokens, {result['output_tokens_per_s']:.1f} tok/s; {len(steps)} steps, "
          f"{model_s:.1f} s in the model runner")
    buckets: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0, 0])
    for decodes, prefill, seconds in steps:
        kind = "prefill" if prefill else "decode"
        key = f"{kind:7s} rows {decodes // 8 * 8:3d}-{decodes // 8 * 8 + 7:<3d}"
        b = buckets[key]
        b[0] += 1
        b[1] += seconds
        b[2] += decodes
        b[3] += prefill
    print(f"{'step kind':24s} {'steps':>6s} {'seconds':>8s} {'share':>6s} {'ms/step':>8s} "
          f"{'decode rows':>11s} {'prefill tokens':>14s}")
    for key in sorted(buckets):
        n, seconds, decodes, prefill = buckets[key]
        print(f"{key:24s} {n:6d} {seconds:8.2f} {100 * seconds / model_s:5.1f}% "
              f"{1e3 * seconds / n:8.1f} {decodes:11d} {prefill:14d}")
    if decoder is not None:
        parts = decoder.decoder.profile()
        total = sum(t for _, t in parts)
        print(f"steps in the C++ decoder: {total:.2f} s in its layers")
        for name, seconds in sorted(parts, key=lambda p: -p[1]):
            print(f"  {name:20s} {seconds:7.2f} s {100 * seconds / model_s:5.1f}% of the run's model time")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--float32", action="store_true", help="the exact float32 defaults instead")
    p.add_argument("--q8", action="store_true", help="weight_dtype='q8' (int8 matmuls) instead")
    p.add_argument("--summarize", metavar="PY_SPY_RAW", help="summarise a py-spy raw profile and exit")
    args = p.parse_args()
    if args.summarize:
        summarize(args.summarize)
    else:
        profile(args.num_prompts, args.float32, args.q8)


if __name__ == "__main__":
    main()
