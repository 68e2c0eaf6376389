"""`pagedlm bench kv-waste`: KV slots allocated but not holding a token.

The analytic part needs only each request's prompt and output length.  It compares

  * paged allocation, block size B: a request holding n tokens owns ceil(n / B) blocks;
  * contiguous reservation of ``max_model_len`` slots per request (what systems before
    PagedAttention did);
  * contiguous reservation of prompt + max_tokens slots, the "oracle" that knows every
    request's final length in advance.

The simulation (documented so its figures can be checked by hand):

  * continuous batching: at most ``max_num_seqs`` requests are live; waiting requests are
    admitted in trace order as soon as a slot frees, at the start of a step;
  * memory is unbounded (no preemption): the question is fragmentation, not admission;
  * a request with P prompt tokens and O output tokens lives O steps; after its j-th step
    (j = 1..O) its KV cache holds P + j - 1 tokens (the first step computes the prompt and
    samples token 1; each later step stores the previous token and samples the next; the
    last sampled token is never stored).  It leaves after step O.

Waste is reported two ways: ``waste`` = 1 - sum of tokens held / sum of slots allocated,
both summed over all steps (slot-steps; this figure does not depend on the schedule, as
each request contributes the same sums whenever it runs), and ``mean_step_waste`` = the
mean over steps of each step's waste fraction (depends on the schedule).

``--measure`` also runs the engine with ``record_kv_usage=True`` and reports the same two
figures from its per-step (allocated slots, tokens held) samples.  The engine samples after
a step has freed the requests it finished, so each request's last step is missing from its
figures; expect them to sit close to, not exactly on, the simulation of the same requests.

The simulation and both waste figures are computed in kv_usage.py (numpy only; `bench plot`
reads its result keys); this module runs the command and the engine.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch

from pagedlm import LLM, SamplingParams
from pagedlm.benchmarks.common import model_label, result_header, write_json
from pagedlm.benchmarks.dataset_args import build_requests, dataset_info
from pagedlm.benchmarks.kv_usage import format_table, measured_waste, simulate_kv_usage
from pagedlm.entrypoints.cli_args import engine_kwargs
from pagedlm.loader.model_loader import resolve_model_source
from pagedlm.loader.tokenizer import load_tokenizer_for


def measure_engine(requests: Sequence[Any], engine_kwargs: dict[str, Any], block_size: int,
                   use_tqdm: bool = True) -> dict[str, Any]:
    """Generate ``requests`` with a fresh engine of ``block_size`` that records its KV usage
    every step (EOS ignored, so each request runs its full output length)."""
    llm = LLM(**{**engine_kwargs, "block_size": block_size, "record_kv_usage": True})
    prompts: list[str | dict] = [
        {"prompt_token_ids": list(r.prompt_token_ids)} if r.prompt_token_ids is not None
        else r.prompt
        for r in requests
    ]
    params = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=r.output_len,
                             ignore_eos=True) for r in requests]
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    result = measured_waste(llm.llm_engine.kv_usage)
    result["block_size"] = block_size
    result["num_requests"] = len(requests)
    result["engine_prompt_tokens"] = sum(len(o.prompt_token_ids) for o in outputs)
    return result


def main(args: argparse.Namespace) -> int:
    """Run `pagedlm bench kv-waste`; returns the exit status."""
    if args.block_size is not None:
        raise ValueError("kv-waste compares several block sizes: use --block-sizes, "
                         "not --block-size")
    kwargs = engine_kwargs(args)
    del kwargs["block_size"]
    source = resolve_model_source(kwargs["model"])
    tokenizer = None
    if args.dataset == "sharegpt" and not args.skip_tokenizer_init:
        tokenizer = load_tokenizer_for(source, args.tokenizer)
    requests = build_requests(args, tokenizer, source.hf_config.vocab_size)
    lengths = [(r.prompt_len, r.output_len) for r in requests]
    sim = simulate_kv_usage(lengths, args.block_sizes, args.max_model_len, args.max_num_seqs)
    results: dict[str, Any] = {"simulated": sim}
    print(f"simulated {len(requests)} requests, {sim['num_steps']} steps, "
          f"at most {args.max_num_seqs} running:")
    print(format_table(sim))

    if args.measure:
        if args.measure_num_prompts < 1:
            raise ValueError(f"--measure-num-prompts must be >= 1, got {args.measure_num_prompts}")
        subset = requests[: args.measure_num_prompts]
        measured = {str(b): measure_engine(subset, kwargs, b) for b in args.block_sizes}
        same = simulate_kv_usage([(r.prompt_len, r.output_len) for r in subset],
                                 args.block_sizes, args.max_model_len, args.max_num_seqs)
        results["measured"] = measured
        results["simulated_measured_requests"] = same
        print(f"\nthe engine on the first {len(subset)} requests, next to the simulation of "
              "the same requests:")
        print(format_table(same, measured))

    report = result_header(
        "kv-waste", model=model_label(kwargs["model"]), dtype=None, dataset=args.dataset,
        num_prompts=len(requests), seed=args.seed, threads=torch.get_num_threads(),
        block_sizes=list(args.block_sizes), max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, dataset_info=dataset_info(args),
    )
    report["results"] = results
    if args.output_json:
        print(f"wrote {write_json(args.output_json, report)}")
    return 0
