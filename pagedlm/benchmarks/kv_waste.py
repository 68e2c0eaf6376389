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
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import numpy as np

from pagedlm.benchmarks.common import model_label, result_header, write_json
from pagedlm.benchmarks.dataset_args import build_requests, dataset_info
from pagedlm.entrypoints.cli_args import engine_kwargs

RESERVE_MAX = "reserve_max_model_len"
RESERVE_ORACLE = "reserve_oracle"
MAX_SERIES_POINTS = 1000


def paged_key(block_size: int) -> str:
    return f"paged_bs{block_size}"


def _downsample(num: int, max_points: int) -> np.ndarray:
    """Indices of at most ``max_points`` evenly spread steps, first and last included."""
    if num <= max_points:
        return np.arange(num)
    return np.unique(np.linspace(0, num - 1, max_points).round().astype(np.int64))


def _waste_figures(tokens: np.ndarray, allocated: np.ndarray) -> tuple[float, float]:
    """(slot-step waste, mean per-step waste) over steps with any slot allocated."""
    used = allocated > 0
    tokens, allocated = tokens[used], allocated[used]
    if allocated.size == 0:
        return float("nan"), float("nan")
    waste = 1.0 - float(tokens.sum()) / float(allocated.sum())
    mean_step = float(np.mean(1.0 - tokens / allocated))
    return waste, mean_step


def simulate_kv_usage(
    lengths: Sequence[tuple[int, int]],
    block_sizes: Sequence[int],
    max_model_len: int,
    max_num_seqs: int | None = None,
    max_series_points: int = MAX_SERIES_POINTS,
) -> dict[str, Any]:
    """Simulate the requests' lifetimes (see the module docstring) and report the waste of
    each allocation scheme.  ``lengths`` holds (prompt_len, output_len) per request;
    ``max_num_seqs`` None admits every request at once."""
    if not lengths:
        raise ValueError("the trace has no requests")
    if any(b < 1 for b in block_sizes) or not block_sizes:
        raise ValueError(f"block sizes must be >= 1, got {list(block_sizes)}")
    prompt = np.array([p for p, _ in lengths], dtype=np.int64)
    output = np.array([o for _, o in lengths], dtype=np.int64)
    if (prompt < 1).any() or (output < 1).any():
        raise ValueError("every request needs at least one prompt and one output token")
    longest = int((prompt + output).max())
    if longest > max_model_len:
        raise ValueError(f"a request needs {longest} tokens, more than max_model_len "
                         f"({max_model_len}) reserves")
    cap = len(lengths) if max_num_seqs is None else max_num_seqs
    if cap < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")

    schemes = [paged_key(b) for b in block_sizes] + [RESERVE_MAX, RESERVE_ORACLE]
    held: list[int] = []
    running: list[int] = []
    allocated: dict[str, list[int]] = {s: [] for s in schemes}
    live = np.empty(0, dtype=np.int64)  # request indices
    age = np.empty(0, dtype=np.int64)  # steps each live request has run, after this step
    next_req = 0
    while next_req < len(lengths) or live.size:
        admit = min(cap - live.size, len(lengths) - next_req)
        if admit > 0:
            live = np.concatenate([live, np.arange(next_req, next_req + admit)])
            age = np.concatenate([age, np.zeros(admit, dtype=np.int64)])
            next_req += admit
        age += 1
        tokens = prompt[live] + age - 1  # [num_live]
        held.append(int(tokens.sum()))
        running.append(int(live.size))
        for b in block_sizes:
            allocated[paged_key(b)].append(int((-(-tokens // b) * b).sum()))
        allocated[RESERVE_MAX].append(int(live.size) * max_model_len)
        allocated[RESERVE_ORACLE].append(int((prompt[live] + output[live]).sum()))
        keep = age < output[live]
        live, age = live[keep], age[keep]

    held_arr = np.array(held, dtype=np.float64)
    waste: dict[str, float] = {}
    mean_step: dict[str, float] = {}
    for s in schemes:
        waste[s], mean_step[s] = _waste_figures(held_arr, np.array(allocated[s], dtype=np.float64))
    keep_idx = _downsample(len(held), max_series_points)
    series: dict[str, list[int]] = {
        "step": (keep_idx + 1).tolist(),
        "tokens_held": [held[i] for i in keep_idx],
        "num_running": [running[i] for i in keep_idx],
    }
    for s in schemes:
        series[s] = [allocated[s][i] for i in keep_idx]
    return {
        "num_requests": len(lengths),
        "num_steps": len(held),
        "max_num_seqs": max_num_seqs,
        "max_model_len": max_model_len,
        "token_steps": int(held_arr.sum()),
        "allocated_slot_steps": {s: int(sum(allocated[s])) for s in schemes},
        "waste": waste,
        "mean_step_waste": mean_step,
        "series": series,
    }


def measured_waste(samples: Sequence[Any], max_series_points: int = MAX_SERIES_POINTS
                   ) -> dict[str, Any]:
    """Waste from an engine's ``kv_usage`` recording (:class:`KVUsageSample` objects)."""
    tokens = np.array([s.tokens_held for s in samples], dtype=np.float64)
    allocated = np.array([s.allocated_slots for s in samples], dtype=np.float64)
    waste, mean_step = _waste_figures(tokens, allocated)
    keep_idx = _downsample(len(samples), max_series_points)
    return {
        "num_steps": len(samples),
        "waste": waste,
        "mean_step_waste": mean_step,
        "peak_allocated_slots": int(allocated.max()) if len(samples) else 0,
        "series": {
            "step": [samples[i].step for i in keep_idx],
            "allocated_slots": [samples[i].allocated_slots for i in keep_idx],
            "tokens_held": [samples[i].tokens_held for i in keep_idx],
            "num_running": [samples[i].num_running for i in keep_idx],
        },
    }


def measure_engine(requests: Sequence[Any], engine_kwargs: dict[str, Any], block_size: int,
                   use_tqdm: bool = True) -> dict[str, Any]:
    """Generate ``requests`` with a fresh engine of ``block_size`` that records its KV usage
    every step (EOS ignored, so each request runs its full output length)."""
    from pagedlm import LLM, SamplingParams

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


_LABELS = {RESERVE_MAX: "contiguous, reserve max_model_len",
           RESERVE_ORACLE: "contiguous, reserve prompt+max_tokens"}


def format_table(sim: dict[str, Any], measured: dict[str, dict[str, Any]] | None = None) -> str:
    """A text table of the waste figures (percent)."""
    lines = [f"{'allocation':<40}{'waste':>9}{'per-step':>10}"]
    for key, waste in sim["waste"].items():
        label = _LABELS.get(key, key.replace("paged_bs", "paged, block size "))
        lines.append(f"{label:<40}{waste:>9.1%}{sim['mean_step_waste'][key]:>10.1%}")
    for bs, m in (measured or {}).items():
        label = f"measured engine, block size {bs}"
        lines.append(f"{label:<40}{m['waste']:>9.1%}{m['mean_step_waste']:>10.1%}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Run `pagedlm bench kv-waste`; returns the exit status."""
    from pagedlm.loader.model_loader import load_tokenizer_for, resolve_model_source

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

    import torch

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
