"""A real speculative verification's attention, replayed against another build of the kernel.

The engine (n-gram speculation, the repeating turns of `pagedlm bench spec-decode`) runs with
its Python layers instead of the C++ decoder, so that each layer's decode attention call
passes through attention/cpu_paged.py; the first step verifying --rows rows against more than
--min-context tokens has its 30 calls (queries, the layer's caches, block tables, lengths)
kept. Those calls then run through the current kernel and through the kernel of --baseline-rev,
taking turns, --rounds times; with --cold a 64 MB write between rounds evicts the caches, as a
step's weights do. The two kernels' outputs must be equal.

    python benchmarks/cpu/verify_attention_replay.py --baseline-rev 5dd5bf8 [--cold]
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
from revision_build import build_revision

import pagedlm.attention.cpu_paged as cpu_paged
from pagedlm import LLM, SamplingParams
from pagedlm.attention.cpu_kernels import load_cpu_kernels
from pagedlm.benchmarks.cli import SPEC_DECODE_MAX_OUTPUT_LEN
from pagedlm.benchmarks.datasets import load_sharegpt_records
from pagedlm.benchmarks.spec_decode import DEFAULT_SPEC, chat_ids, sample_repeating

SOURCES = ["pagedlm/csrc/paged_attention_cpu.cpp", "pagedlm/csrc/cpu_vec.h"]


def capture(rows: int, min_context: int, layers: int) -> list[tuple]:
    llm = LLM(num_threads=2, weight_dtype="q8", kv_cache_dtype="float16", enable_prefix_caching=False,
              speculative_config=DEFAULT_SPEC)
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    runner.cpu_decoder, runner._forward = None, runner._forward_eager
    calls: list[tuple] = []
    decode = cpu_paged.paged_decode_attention

    def kept(query, k_cache, v_cache, block_tables, seq_lens, scale, *options):
        if query.shape[0] == rows and min(seq_lens) > min_context and len(calls) < layers:
            calls.append(((query.float() * scale).contiguous(), k_cache, v_cache,
                          block_tables.contiguous().clone(), list(seq_lens)))
        return decode(query, k_cache, v_cache, block_tables, seq_lens, scale, *options)

    cpu_paged.paged_decode_attention = kept
    tokenizer = llm.get_tokenizer()
    for r in sample_repeating(tokenizer, 16, 0, SPEC_DECODE_MAX_OUTPUT_LEN, load_sharegpt_records()):
        llm.generate({"prompt_token_ids": chat_ids(tokenizer, r.prompt)},
                     SamplingParams(temperature=0, max_tokens=r.output_len), use_tqdm=False)
        if len(calls) == layers:
            return calls
    raise SystemExit(f"no step verified {rows} rows against more than {min_context} tokens")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-rev", required=True)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--min-context", type=int, default=600)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--cold", action="store_true", help="evict the caches between rounds")
    args = p.parse_args()
    layers = 30  # SmolLM2-135M
    calls = capture(args.rows, args.min_context, layers)
    kernels = {"current": load_cpu_kernels()}
    with tempfile.TemporaryDirectory() as tmp:
        kernels[args.baseline_rev] = build_revision(args.baseline_rev, SOURCES, Path(tmp))
        outs = {name: [m.paged_decode(q, k, v, bt, sl, 0.0, 0, None) for q, k, v, bt, sl in calls]
                for name, m in kernels.items()}
        assert all(torch.equal(a, b) for a, b in zip(*outs.values())), "the kernels' outputs differ"
        junk = torch.empty(64 * 1024 * 1024 // 4)
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for step in range(args.rounds + 1):
            for name, m in kernels.items():
                if args.cold:
                    junk.fill_(step)
                start = time.perf_counter()
                for q, k, v, bt, sl in calls:
                    m.paged_decode(q, k, v, bt, sl, 0.0, 0, None)
                if step:  # the first round warms up
                    times[name].append(time.perf_counter() - start)
    lens = calls[0][4]
    medians = {name: sorted(t)[len(t) // 2] * 1e3 for name, t in times.items()}
    print(f"{args.rows} verification rows against {lens[-1]}..{lens[0]} tokens, {layers} layers"
          f"{', caches evicted between rounds' if args.cold else ''}: "
          + "  ".join(f"{name} {ms:.2f} ms" for name, ms in medians.items())
          + f"  {args.baseline_rev} / current = {medians[args.baseline_rev] / medians['current']:.2f}x")


if __name__ == "__main__":
    main()
