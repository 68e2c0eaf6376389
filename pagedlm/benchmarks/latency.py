"""`pagedlm bench latency`: how long one batch takes, end to end and per engine step.

Each iteration submits ``batch_size`` requests of ``input_len`` random token ids, each
generating exactly ``output_len`` tokens (EOS ignored), and steps the engine until all
finish.  The iteration's latency runs from the first request added to the last step;
every step is timed too, and a step in which every scheduled request is past its prompt
is a *decode step*.  The prefix cache is emptied before each iteration, so every
iteration computes its prompts afresh.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.benchmarks.common import model_label, result_header, write_json
from pagedlm.benchmarks.metrics import summarize
from pagedlm.engine.output_processor import RequestOutputKind
from pagedlm.entrypoints.cli_args import engine_kwargs

PERCENTILES = (50.0, 90.0, 99.0)


def run_iteration(engine: Any, prompts: list[list[int]], output_len: int, tag: str
                  ) -> tuple[float, list[float], list[bool]]:
    """One batch through ``engine`` (an LLMEngine): (latency s, step times s, is-decode)."""
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=output_len, ignore_eos=True)
    engine.reset_prefix_cache()
    step_times: list[float] = []
    is_decode: list[bool] = []
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"latency-{tag}-{i}", None, params, prompt_token_ids=ids,
                           output_kind=RequestOutputKind.FINAL_ONLY)
    while engine.has_unfinished_requests():
        before = engine.last_step
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        step = engine.last_step
        if step is before:  # nothing was scheduled
            continue
        step_times.append(t1 - t0)
        is_decode.append(step.scheduled.num_prompt_tokens == 0)
    return time.perf_counter() - start, step_times, is_decode


def run_latency(llm: Any, batch_size: int, input_len: int, output_len: int,
                num_iters_warmup: int, num_iters: int, seed: int = 0,
                verbose: bool = True) -> dict[str, Any]:
    """Warm up, then time ``num_iters`` iterations; returns the latency statistics."""
    engine = llm.llm_engine
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, engine.vocab_size, size=(batch_size, input_len)).tolist()
    for i in range(num_iters_warmup):
        run_iteration(engine, prompts, output_len, f"warmup{i}")
    latencies: list[float] = []
    decode_steps: list[float] = []
    prefill_steps: list[float] = []
    steps_per_iter: list[int] = []
    for i in range(num_iters):
        latency, step_times, is_decode = run_iteration(engine, prompts, output_len, str(i))
        latencies.append(latency)
        steps_per_iter.append(len(step_times))
        for t, decode in zip(step_times, is_decode):
            (decode_steps if decode else prefill_steps).append(t)
        if verbose:
            print(f"iteration {i + 1}/{num_iters}: {latency * 1000:.1f} ms, "
                  f"{len(step_times)} steps")
    return {
        "latencies_s": latencies,
        "latency_s": summarize(latencies, PERCENTILES),
        "decode_step_ms": summarize(decode_steps, PERCENTILES, 1000.0),
        "prefill_step_ms": summarize(prefill_steps, PERCENTILES, 1000.0),
        "steps_per_iteration": steps_per_iter,
    }


def main(args: argparse.Namespace) -> int:
    """Run `pagedlm bench latency`; returns the exit status."""
    for name in ("batch_size", "input_len", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")
    kwargs = engine_kwargs(args)
    llm = LLM(**kwargs)
    result = run_latency(llm, args.batch_size, args.input_len, args.output_len,
                         args.num_iters_warmup, args.num_iters, args.seed)
    lat, dec = result["latency_s"], result["decode_step_ms"]
    print(f"batch latency: mean {lat['mean'] * 1000:.1f} ms, p50 {lat['p50'] * 1000:.1f} ms, "
          f"p99 {lat['p99'] * 1000:.1f} ms")
    print(f"decode step: mean {dec['mean']:.2f} ms, p50 {dec['p50']:.2f} ms, "
          f"p99 {dec['p99']:.2f} ms")
    engine = llm.llm_engine
    report = result_header(
        "latency", model=model_label(kwargs["model"]),
        dtype=str(engine.dtype).removeprefix("torch."), dataset="random",
        num_prompts=args.batch_size, seed=args.seed, threads=torch.get_num_threads(),
        batch_size=args.batch_size, input_len=args.input_len, output_len=args.output_len,
        num_iters_warmup=args.num_iters_warmup, num_iters=args.num_iters,
        engine_args={k: v for k, v in kwargs.items() if k != "model"},
    )
    report["results"] = result
    if args.output_json:
        print(f"wrote {write_json(args.output_json, report)}")
    return 0
