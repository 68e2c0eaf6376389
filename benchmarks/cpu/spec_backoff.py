"""The n-gram proposer's back-off settings against each other, batch 1, interleaved: the
workloads of `pagedlm bench spec-decode` (ShareGPT turns whose reply repeats the prompt,
and plain ShareGPT chat; greedy, chat template, each reply's length as max_tokens), each
request through an engine without speculation and through one speculating engine per
setting, in an order that rotates per request (so that a VM speeding up or slowing down
favours none). Greedy outputs must be equal across all engines.

A setting is NAME=ATTR:VALUE[,ATTR:VALUE...] over the proposer's attributes
(engine/spec_decode.py: `rest_steps`, `partial_extra` with `none` for None, `max_rest_steps`,
`match_slack`, `n_min`) or `num_speculative_tokens` (the engine's config);
"current" (the defaults) always runs. Prints, per workload and seed, each setting's
speed-up over the engine without speculation: whole request and after the first token.

    python benchmarks/cpu/spec_backoff.py [--seeds 0 1] [--num-prompts 16]
        [--weight-dtype q8 --kv-cache-dtype float16]
        [--setting old=rest_steps:8,partial_extra:1 ...]
"""

import argparse
import time

from pagedlm import LLM, SamplingParams
from pagedlm.benchmarks.cli import SPEC_DECODE_MAX_OUTPUT_LEN as MAX_OUTPUT_LEN
from pagedlm.benchmarks.datasets import load_sharegpt_records
from pagedlm.benchmarks.spec_decode import DEFAULT_SPEC, batch1_workloads, chat_ids


def parse_setting(text: str) -> tuple[str, dict]:
    name, _, body = text.partition("=")
    attrs = {}
    for pair in filter(None, body.split(",")):
        attr, _, value = pair.partition(":")
        attrs[attr] = None if value == "none" else int(value)
    return name, attrs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--num-speculative-tokens", type=int, default=DEFAULT_SPEC["num_speculative_tokens"])
    p.add_argument("--weight-dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--setting", action="append", default=[], help="NAME=ATTR:VALUE,... (repeatable)")
    args = p.parse_args()

    kwargs = dict(num_threads=args.num_threads, weight_dtype=args.weight_dtype,
                  kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=False)
    spec = {**DEFAULT_SPEC, "num_speculative_tokens": args.num_speculative_tokens}
    engines = {"off": LLM(**kwargs)}
    for name, attrs in [("current", {})] + [parse_setting(s) for s in args.setting]:
        drafts = attrs.pop("num_speculative_tokens", spec["num_speculative_tokens"])
        engines[name] = LLM(**kwargs, speculative_config={**spec, "num_speculative_tokens": drafts})
        proposer = engines[name].llm_engine.core.proposer
        for attr, value in attrs.items():
            if not hasattr(proposer, attr):
                raise SystemExit(f"the proposer has no attribute {attr!r}")
            setattr(proposer, attr, value)
    names = list(engines)
    tokenizer = engines["off"].get_tokenizer()
    records = load_sharegpt_records()
    print(f"speed-up over no speculation, whole request / after the first token "
          f"({args.num_speculative_tokens} drafts, weights {args.weight_dtype}, "
          f"KV cache {args.kv_cache_dtype})")
    for seed in args.seeds:
        workloads = batch1_workloads(tokenizer, args.num_prompts, seed, MAX_OUTPUT_LEN, records)
        for workload, requests in workloads.items():
            whole = dict.fromkeys(names, 0.0)
            after_first = dict.fromkeys(names, 0.0)
            for i, r in enumerate(requests):
                ids = chat_ids(tokenizer, r.prompt)
                params = SamplingParams(temperature=0, max_tokens=r.output_len)
                order = names[i % len(names):] + names[:i % len(names)]
                outputs = {}
                for name in order:
                    start = time.perf_counter()
                    out = engines[name].generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
                    whole[name] += time.perf_counter() - start
                    after_first[name] += out.metrics.finished_time - out.metrics.first_token_time
                    outputs[name] = list(out.outputs[0].token_ids)
                if any(outputs[n] != outputs["off"] for n in names):
                    raise SystemExit(f"seed {seed} {workload} request {i}: greedy outputs differ")
            print(f"seed {seed} {workload:8s} " + "  ".join(
                f"{n} {whole['off'] / whole[n]:.3f} / {after_first['off'] / after_first[n]:.3f}"
                for n in names[1:]), flush=True)


if __name__ == "__main__":
    main()
