"""Should the offline `LLM` keep its engine core in process, or use the server's core
process? Both run the same ShareGPT requests (submitted at once, temperature 1, top-p 1, EOS
ignored, text detokenised), alternating in pairs, and the output tokens/s of each run and
the ratio process / in-process of each pair are reported.

    in-process   LLMEngine: frontend and core in one thread (what `LLM` uses)
    process      EngineFrontend here + ProcessCoreClient: the core in a spawned process,
                 token ids over a pipe, detokenisation here, overlapping the next step

usage: python benchmarks/cpu/offline_core_process.py [--num-prompts 64] [--pairs 2]
           [--num-threads 2] [--output-json PATH]
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import time

from pagedlm.benchmarks.common import machine_info
from pagedlm.benchmarks.datasets import sample_sharegpt
from pagedlm.config import EngineArgs
from pagedlm.engine.core_client import AddCommand, FinishCommand
from pagedlm.engine.core_process import ProcessCoreClient
from pagedlm.engine.frontend import EngineFrontend
from pagedlm.engine.llm_engine import LLMEngine, load_frontend_parts
from pagedlm.engine.output_processor import RequestOutputKind
from pagedlm.sampling_params import SamplingParams


def _params(requests) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=r.output_len, ignore_eos=True)
            for r in requests]


def run_in_process(args: EngineArgs, requests) -> float:
    engine = LLMEngine(args)
    try:
        engine.add_request("warmup", None, SamplingParams(max_tokens=2),
                           prompt_token_ids=list(requests[0].prompt_token_ids))
        while engine.has_unfinished_requests():
            engine.step()
        engine.reset_prefix_cache()
        start = time.perf_counter()
        for i, (r, p) in enumerate(zip(requests, _params(requests))):
            engine.add_request(str(i), None, p, prompt_token_ids=list(r.prompt_token_ids),
                               output_kind=RequestOutputKind.FINAL_ONLY)
        num_tokens = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                num_tokens += len(out.outputs[0].token_ids)
        return num_tokens / (time.perf_counter() - start)
    finally:
        engine.shutdown()


def run_core_process(args: EngineArgs, requests) -> float:
    _, tokenizer, eos_ids = load_frontend_parts(args)
    client = ProcessCoreClient(args, eos_ids)
    frontend = EngineFrontend(tokenizer, client.info, args.seed)
    messages: queue.SimpleQueue = queue.SimpleQueue()
    client.start(messages.put)

    def run(batch: list[tuple[str, list[int], SamplingParams]]) -> int:
        for request_id, ids, params in batch:
            client.submit(AddCommand(frontend.make_request(
                request_id, None, params, ids, RequestOutputKind.FINAL_ONLY)))
        remaining, num_tokens = len(batch), 0
        while remaining:
            message = messages.get()
            assert message.dead is None, message.dead
            assert all(a.error_kind is None for a in message.acks), message.acks
            if message.outputs is None:
                continue
            outputs, stopped, _ = frontend.process(message.outputs)
            if stopped:
                client.submit(FinishCommand(stopped))
            for out in outputs:
                remaining -= 1
                num_tokens += len(out.outputs[0].token_ids)
        return num_tokens

    try:
        run([("warmup", list(requests[0].prompt_token_ids), SamplingParams(max_tokens=2))])
        # The prefix cache must not serve the warm-up's prompt: a fresh core would not have it.
        batch = [(str(i), list(r.prompt_token_ids), p)
                 for i, (r, p) in enumerate(zip(requests, _params(requests)))]
        start = time.perf_counter()
        num_tokens = run(batch)
        return num_tokens / (time.perf_counter() - start)
    finally:
        client.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--output-json", default=None)
    cli = parser.parse_args()
    args = EngineArgs(weight_dtype="q8", kv_cache_dtype="float16", num_threads=cli.num_threads,
                      enable_prefix_caching=False)
    _, tokenizer, _ = load_frontend_parts(args)
    requests = sample_sharegpt(tokenizer, cli.num_prompts, seed=0)
    requests = [r if r.prompt_token_ids is not None else
                type(r)(r.prompt, r.prompt_len, r.output_len,
                        tuple(tokenizer(r.prompt).input_ids)) for r in requests]
    pairs = []
    for i in range(cli.pairs):
        inproc = run_in_process(args, requests)
        proc = run_core_process(args, requests)
        pairs.append({"in_process_tok_s": inproc, "core_process_tok_s": proc,
                      "ratio": proc / inproc})
        print(f"pair {i}: in-process {inproc:.1f} tok/s, core process {proc:.1f} tok/s, "
              f"ratio {proc / inproc:.3f}", flush=True)
    report = {"benchmark": "offline_core_process", "model": "SmolLM2-135M-Instruct (embedded)",
              "engine_args": "weight_dtype q8, kv_cache_dtype float16, prefix caching off",
              "dataset": f"sharegpt, {cli.num_prompts} prompts, seed 0, EOS ignored",
              "machine": machine_info(cli.num_threads), "pairs": pairs,
              "median_ratio": statistics.median(p["ratio"] for p in pairs)}
    if cli.output_json:
        with open(cli.output_json, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report["pairs"], indent=1))


if __name__ == "__main__":
    main()
