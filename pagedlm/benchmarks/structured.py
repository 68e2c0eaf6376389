"""`pagedlm bench structured`: what structured outputs cost.

The same requests with a JSON schema on every request and unconstrained (submitted at
once, temperature 1, EOS ignored). The first constrained run (max_tokens the dataset's
output length; a finished grammar ends its request) fixes how many tokens each request
generates; every unconstrained run generates exactly as many, so both have the same batch
shape step by step and the ratio of output tokens/s is the overhead. Pairs alternate which
run goes first. Also reported: the time a step
waits for its masks and applies them (the critical path), and the time llguidance takes to
fill the masks of 1, 16 and 64 sequences in mid-document states (median and p99).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedlm.benchmarks.common import model_label, result_header, write_json
from pagedlm.benchmarks.dataset_args import build_requests, dataset_info
from pagedlm.config import EngineArgs
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.engine.output_processor import RequestOutputKind
from pagedlm.entrypoints.cli_args import engine_kwargs
from pagedlm.sampling_params import SamplingParams
from pagedlm.structured import StructuredOutputManager, StructuredOutputsParams
from pagedlm.worker.model_runner import ModelRunner

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "answer": {"type": "string"},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 6},
    },
    "required": ["title", "answer", "confidence", "tags"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"title": "Paged attention", "answer": "Blocks of the KV cache are "
                       "reached through a table, so memory is allocated as it is needed and",
                       "confidence": 0.9, "tags": []}, separators=(",", ":"))


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(engine: LLMEngine, requests, lengths: list[int] | None) -> dict:
    """Constrained (lengths None: the dataset's output lengths, grammar may end a request
    early) or unconstrained with the given output length per request."""
    constrained = lengths is None
    engine.reset_prefix_cache()
    waits: list[float] = []
    original = ModelRunner._apply_grammar

    def timed(logits, req_ids, pending):
        t0 = time.perf_counter()
        original(logits, req_ids, pending)
        waits.append(time.perf_counter() - t0)

    ModelRunner._apply_grammar = staticmethod(timed)
    try:
        index_of: dict[str, int] = {}  # request id -> position in `requests`
        for i, r in enumerate(requests):
            structured = StructuredOutputsParams(json=SCHEMA) if constrained else None
            params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, seed=i,
                                    max_tokens=r.output_len if constrained else lengths[i],
                                    structured_outputs=structured)
            index_of[f"{int(constrained)}-{i}"] = i
            engine.add_request(f"{int(constrained)}-{i}", None, params,
                               prompt_token_ids=list(r.prompt_token_ids),
                               output_kind=RequestOutputKind.FINAL_ONLY)
        start = time.perf_counter()
        num_tokens, num_steps, finished_by_grammar = 0, 0, 0
        produced = [0] * len(requests)
        while engine.has_unfinished_requests():
            num_steps += 1
            for out in engine.step():
                c = out.outputs[0]
                num_tokens += len(c.token_ids)
                produced[index_of[out.request_id]] = len(c.token_ids)
                finished_by_grammar += c.finish_reason == "stop"
                if constrained and c.finish_reason == "stop":
                    json.loads(c.text)  # every finished output is a document
        elapsed = time.perf_counter() - start
    finally:
        ModelRunner._apply_grammar = staticmethod(original)
    result = {"output_tok_s": num_tokens / elapsed, "output_tokens": num_tokens,
              "steps": num_steps, "seconds": elapsed, "lengths": produced}
    if constrained:
        result.update(finished_by_grammar=finished_by_grammar,
                      mask_wait_apply_ms_median=1e3 * statistics.median(waits),
                      mask_wait_apply_ms_p99=1e3 * _pct(waits, 0.99),
                      mask_wait_apply_share=sum(waits) / elapsed)
    return result


def fill_times(tokenizer, eos_ids, vocab_size: int, repeats: int = 200) -> dict:
    """llguidance filling the masks of k sequences, each part-way through DOCUMENT."""
    prefix = tokenizer(DOCUMENT, add_special_tokens=False).input_ids
    out = {}
    for k in (1, 16, 64):
        manager = StructuredOutputManager(lambda: tokenizer, vocab_size, eos_ids)
        ids = [f"s{i}" for i in range(k)]
        manager.add(ids, StructuredOutputsParams(json=SCHEMA))
        for i, seq_id in enumerate(ids):  # different depths into the document
            for token in prefix[: 5 + (i * 7) % (len(prefix) - 6)]:
                assert manager.consume(seq_id, token)[1] is None
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            manager.bitmask_for(ids).result()
            times.append(time.perf_counter() - t0)
        out[k] = {"median_ms": 1e3 * statistics.median(times), "p99_ms": 1e3 * _pct(times, 0.99)}
    return out


def main(args: argparse.Namespace) -> int:
    """Run `pagedlm bench structured`; returns the exit status."""
    if args.pairs < 1:
        raise ValueError(f"--pairs must be >= 1, got {args.pairs}")
    kwargs = engine_kwargs(args)
    if kwargs.get("skip_tokenizer_init"):
        raise ValueError("structured outputs need the tokenizer: drop --skip-tokenizer-init")
    # Prefix caching off: the second run of a pair must not reuse the first one's prompts.
    engine = LLMEngine(EngineArgs(**{**kwargs, "enable_prefix_caching": False}))
    tokenizer = engine.tokenizer
    requests = build_requests(args, tokenizer, engine.vocab_size)
    requests = [r if r.prompt_token_ids is not None else
                type(r)(r.prompt, r.prompt_len, r.output_len,
                        tuple(tokenizer(r.prompt).input_ids)) for r in requests]
    engine.add_request("warmup", None, SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        prompt_token_ids=list(requests[0].prompt_token_ids))
    while engine.has_unfinished_requests():
        engine.step()
    pairs = []
    lengths = None
    for i in range(args.pairs):
        # The first pair runs constrained first (its lengths fix the unconstrained run's);
        # then the order alternates, so that a machine that speeds up or slows down during
        # the benchmark does not favour one side. Seeded sampling makes the constrained
        # lengths the same in every pair (checked).
        if i % 2 == 0:
            json_run = run(engine, requests, None)
            free = run(engine, requests, json_run["lengths"])
        else:
            free = run(engine, requests, lengths)
            json_run = run(engine, requests, None)
        lengths = lengths or json_run["lengths"]
        assert free["lengths"] == json_run["lengths"] == lengths
        pairs.append({"unconstrained": free, "json_schema": json_run,
                      "ratio": json_run["output_tok_s"] / free["output_tok_s"]})
        print(f"pair {i}: unconstrained {free['output_tok_s']:.1f} tok/s, json schema "
              f"{json_run['output_tok_s']:.1f} tok/s, ratio {pairs[-1]['ratio']:.3f}", flush=True)
    eos_ids = engine.eos_token_ids
    vocab_size = engine.vocab_size
    dtype = str(engine.dtype).removeprefix("torch.")
    engine.shutdown()
    fills = fill_times(tokenizer, eos_ids, vocab_size, repeats=args.fill_repeats)
    ratios = sorted(p["ratio"] for p in pairs)
    print(f"json schema / unconstrained output tok/s: median {statistics.median(ratios):.3f} "
          f"(range {ratios[0]:.3f}-{ratios[-1]:.3f}, {len(ratios)} pairs)")
    for k, f in fills.items():
        print(f"llguidance mask fill, {k} sequences: median {f['median_ms']:.2f} ms, "
              f"p99 {f['p99_ms']:.2f} ms")
    report = result_header(
        "structured", model=model_label(kwargs["model"]), dtype=dtype, dataset=args.dataset,
        num_prompts=args.num_prompts, seed=args.seed, threads=torch.get_num_threads(),
        dataset_info=dataset_info(args), pairs_requested=args.pairs,
        engine_args={k: v for k, v in kwargs.items() if k != "model"},
        note="prefix caching off; temperature 1, EOS ignored")
    report["schema"] = SCHEMA
    report["results"] = {"pairs": pairs, "ratio_median": statistics.median(ratios),
                         "mask_fill_ms_by_batch": fills}
    if args.output_json:
        print(f"wrote {write_json(args.output_json, report)}")
    return 0
