"""`pagedlm bench spec-decode`: what speculative decoding buys, against the same engine
without it, in one run.

Two engines with the same options, one with `--speculative-config` (default n-gram, 15
drafts), take the same requests:

  * batch-1 latency on two ShareGPT workloads, one request at a time, greedy, each
    request's reply length as max_tokens, prompts in the model's chat template, the two
    engines alternating per request (a machine that speeds up or slows down favours
    neither):
      - repeat:   turns whose reply repeats its prompt (edit, fix, translate or reformat a
                  given text: at least half of the reply's 6-word sequences appear in the
                  prompt), where drafts from the prompt are often right;
      - sharegpt: ShareGPT as vLLM samples it (plain chat);
    ms per output token = the requests' generate time / their output tokens, and TPOT =
    the time after each request's first token / the tokens after it, pooled over the
    requests and, as vLLM's `benchmark_serving` reports it ("Mean TPOT", "excl. 1st
    token"), the mean of each request's own (greedy: both engines produce the same
    tokens, which is checked); TTFT, the mean time to the first
    token (the prompt's prefill, which speculation does not shorten), and its share of
    the requests' time, which bounds what the whole request can gain; and each request's
    own figures (the JSON's "requests");
  * throughput: --throughput-prompts ShareGPT requests at once (temperature 1, EOS
    ignored, as `bench throughput`), output tokens/s of each engine, --throughput-pairs
    times in alternating order; the median ratio and its range.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from pagedlm import LLM, SamplingParams
from pagedlm.benchmarks.common import model_label, result_header, write_json
from pagedlm.benchmarks.datasets import (
    MAX_PROMPT_LEN,
    MAX_TOTAL_LEN,
    SampleRequest,
    conversation_pairs,
    load_sharegpt_records,
    sample_sharegpt,
)
from pagedlm.benchmarks.throughput import run_pagedlm
from pagedlm.entrypoints.cli_args import engine_kwargs

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 15}
REPEAT_MIN_SHARE = 0.5  # of the reply's word 6-grams found in the prompt
MIN_REPLY_TOKENS = 32


def _ngrams(words: list[str], n: int = 6) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def repeat_share(prompt: str, reply: str) -> float:
    """The share of the reply's word 6-grams that also appear in the prompt."""
    reply_grams = _ngrams(reply.split())
    if not reply_grams:
        return 0.0
    return len(reply_grams & _ngrams(prompt.split())) / len(reply_grams)


def sample_repeating(tokenizer: Any, num: int, seed: int, max_output: int,
                     records: list[dict] | None = None) -> list[SampleRequest]:
    """ShareGPT (prompt, reply) turns whose reply repeats the prompt, shuffled by seed."""
    pairs = conversation_pairs(records if records is not None else load_sharegpt_records())
    random.Random(seed).shuffle(pairs)
    out: list[SampleRequest] = []
    for prompt, reply in pairs:
        if len(out) >= num:
            break
        if repeat_share(prompt, reply) < REPEAT_MIN_SHARE:
            continue
        prompt_len = len(tokenizer(prompt).input_ids)
        reply_len = len(tokenizer(reply).input_ids)
        if (prompt_len > MAX_PROMPT_LEN or reply_len < MIN_REPLY_TOKENS
                or prompt_len + reply_len > MAX_TOTAL_LEN):
            continue
        out.append(SampleRequest(prompt, prompt_len, min(reply_len, max_output)))
    if len(out) < num:
        raise ValueError(f"only {len(out)} repeating ShareGPT turns pass the filters, {num} asked")
    return out


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5: a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def batch1_workloads(tokenizer: Any, num: int, seed: int, max_output_len: int,
                     records: list[dict[str, Any]]) -> dict[str, list[SampleRequest]]:
    """The two batch-1 workloads: "repeat" (turns whose reply repeats the prompt) and
    "sharegpt" (plain chat), each request's output capped at `max_output_len`."""
    return {
        "repeat": sample_repeating(tokenizer, num, seed, max_output_len, records),
        "sharegpt": [SampleRequest(r.prompt, r.prompt_len, min(r.output_len, max_output_len))
                     for r in sample_sharegpt(tokenizer, num, seed=seed, records=records)],
    }


def batch1(engines: dict[str, Any], requests: list[SampleRequest],
           allow_divergence: bool = False) -> dict[str, Any]:
    """Each request alone through each engine, alternating which goes first. Greedy
    outputs must be equal (RuntimeError otherwise) unless `allow_divergence`, which counts
    the requests that part instead (q8 weights, whose GEMM's sums depend on a step's rows;
    README, Speculative decoding)."""
    tokenizer = engines["off"].get_tokenizer()
    rows: list[dict[str, Any]] = []  # each request's figures; the totals below sum them
    num_differing = 0
    for i, r in enumerate(requests):
        ids = chat_ids(tokenizer, r.prompt)
        params = SamplingParams(temperature=0, max_tokens=r.output_len)
        outputs = {}
        row: dict[str, Any] = {"prompt_tokens": len(ids), "max_tokens": r.output_len}
        for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
            llm = engines[name]
            llm.llm_engine.reset_prefix_cache()  # neither reuses the other's prompt
            start = time.perf_counter()
            out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
            elapsed = time.perf_counter() - start
            outputs[name] = out.outputs[0].token_ids
            n = len(outputs[name])
            m = out.metrics
            row[name] = {"ms": elapsed * 1e3, "output_tokens": n}
            if m is not None and m.first_token_time is not None:
                row[name]["ttft_ms"] = m.time_to_first_token * 1e3
                if n > 1:
                    row[name]["decode_ms"] = (m.finished_time - m.first_token_time) * 1e3
                    row[name]["tpot_ms"] = row[name]["decode_ms"] / (n - 1)
        row["same_output"] = outputs["off"] == outputs["on"]
        rows.append(row)
        if not row["same_output"]:
            if not allow_divergence:
                raise RuntimeError(f"request {i}: greedy outputs differ with speculation "
                                   "(--allow-divergence counts such requests instead)")
            num_differing += 1
    result: dict[str, Any] = {"num_requests": len(requests), "num_differing": num_differing,
                              "requests": rows}
    for name in ("off", "on"):
        own = [row[name] for row in rows]
        seconds = sum(x["ms"] for x in own) / 1e3
        tokens = sum(x["output_tokens"] for x in own)
        ttfts = [x["ttft_ms"] for x in own if "ttft_ms" in x]
        decoded = [x for x in own if "tpot_ms" in x]
        result[name] = {"ms_per_output_token": seconds * 1e3 / tokens,
                        "tpot_ms": (sum(x["decode_ms"] for x in decoded)
                                    / max(1, sum(x["output_tokens"] - 1 for x in decoded))),
                        "mean_tpot_ms": statistics.fmean(x["tpot_ms"] for x in decoded) if decoded else 0.0,
                        "ttft_ms": sum(ttfts) / max(1, len(ttfts)),
                        "first_token_share": sum(ttfts) / 1e3 / seconds if seconds else 0.0,
                        "median_request_ms_per_token": statistics.median(
                            x["ms"] / max(1, x["output_tokens"]) for x in own),
                        "output_tokens": tokens, "seconds": seconds}
    result["latency_ratio_off_over_on"] = (result["off"]["ms_per_output_token"]
                                           / result["on"]["ms_per_output_token"])
    result["tpot_ratio_off_over_on"] = result["off"]["tpot_ms"] / result["on"]["tpot_ms"]
    result["mean_tpot_ratio_off_over_on"] = (result["off"]["mean_tpot_ms"] / result["on"]["mean_tpot_ms"]
                                             if result["on"]["mean_tpot_ms"] else 0.0)
    return result


def _spec_delta(before, after) -> dict[str, float]:
    drafts = after.spec_num_drafts - before.spec_num_drafts
    proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    return {"verifications": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0}


def main(args: argparse.Namespace) -> int:
    if args.throughput_pairs < 1:
        raise ValueError(f"--throughput-pairs must be >= 1, got {args.throughput_pairs}")
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    kwargs = engine_kwargs(args)
    spec = kwargs.pop("speculative_config") or json.dumps(DEFAULT_SPEC)
    if kwargs.get("skip_tokenizer_init"):
        raise ValueError("this benchmark needs the tokenizer: drop --skip-tokenizer-init")
    engines = {"off": LLM(**kwargs), "on": LLM(**kwargs, speculative_config=spec)}
    tokenizer = engines["off"].get_tokenizer()
    records = load_sharegpt_records(args.dataset_path)
    workloads = batch1_workloads(tokenizer, args.num_prompts, args.seed, args.max_output_len, records)
    warm = workloads["sharegpt"][:1]
    batch1(engines, [SampleRequest(w.prompt, w.prompt_len, 8) for w in warm])  # first calls
    report = result_header(
        "spec-decode", model=model_label(kwargs.get("model")), dtype=kwargs.get("dtype"),
        dataset="sharegpt", num_prompts=args.num_prompts, seed=args.seed,
        threads=kwargs.get("num_threads"), speculative_config=json.loads(spec)
        if isinstance(spec, str) else spec)
    report["batch1"] = {}
    for name, requests in workloads.items():
        before = engines["on"].stats()
        result = batch1(engines, requests, args.allow_divergence)
        result["speculation"] = _spec_delta(before, engines["on"].stats())
        report["batch1"][name] = result
        print(f"{name:9s} batch 1: {result['off']['ms_per_output_token']:.2f} -> "
              f"{result['on']['ms_per_output_token']:.2f} ms/token "
              f"({result['latency_ratio_off_over_on']:.2f}x; after the first token "
              f"{result['off']['tpot_ms']:.2f} -> {result['on']['tpot_ms']:.2f} ms, "
              f"{result['tpot_ratio_off_over_on']:.2f}x, per-request mean "
              f"{result['mean_tpot_ratio_off_over_on']:.2f}x; first token {result['off']['ttft_ms']:.0f} -> "
              f"{result['on']['ttft_ms']:.0f} ms, {result['off']['first_token_share']:.0%} of the "
              f"time without), acceptance "
              f"{result['speculation']['acceptance_rate']:.1%}, mean acceptance length "
              f"{result['speculation']['mean_acceptance_length']:.2f}"
              + (f"; {result['num_differing']} of {len(requests)} requests' greedy outputs "
                 "parted" if result["num_differing"] else ""))
    if args.throughput_prompts:
        requests = sample_sharegpt(tokenizer, args.throughput_prompts, seed=args.seed,
                                   records=records)
        # Pairs in alternating order (off first, then on first, ...): one pair on this
        # kind of machine moves by more than the effect measured.
        pairs = []
        for i in range(args.throughput_pairs):
            runs = {}
            for name in ("off", "on") if i % 2 == 0 else ("on", "off"):
                before = engines[name].stats()
                runs[name] = run_pagedlm(engines[name], requests, use_tqdm=False)
                if name == "on":
                    runs[name]["speculation"] = _spec_delta(before, engines[name].stats())
            runs["ratio_on_over_off"] = (runs["on"]["output_tokens_per_s"]
                                         / runs["off"]["output_tokens_per_s"])
            pairs.append(runs)
        ratios = sorted(p["ratio_on_over_off"] for p in pairs)
        report["throughput"] = {"pairs": pairs, "ratio_on_over_off": statistics.median(ratios),
                                "ratio_min": ratios[0], "ratio_max": ratios[-1]}
        print(f"throughput, {args.throughput_prompts} ShareGPT requests at once, "
              f"{len(pairs)} pair(s): "
              + ", ".join(f"{p['off']['output_tokens_per_s']:.1f} -> "
                          f"{p['on']['output_tokens_per_s']:.1f}" for p in pairs)
              + f" output tok/s; median ratio {report['throughput']['ratio_on_over_off']:.3f}x"
              f" ({ratios[0]:.3f}-{ratios[-1]:.3f})")
    if args.output_json:
        write_json(args.output_json, report)
    return 0
