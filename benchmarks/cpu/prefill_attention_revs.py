"""The CPU prefill attention kernel (pagedlm/csrc/prefill_attention_cpu.cpp) of the working
tree against the same kernel at another git revision, side by side in one process.

The prompts are those of `pagedlm bench spec-decode`'s batch-1 workloads (16 repeating turns
and 16 ShareGPT chats, seed 0, chat template), each cut into the engine's 512-token CPU steps
(a later chunk attends to the cached chunks before it); SmolLM2's 9 query / 3 kv heads of
64 dims, a float16 cache of random values. One round runs every chunk of every prompt once, as
one layer of the prefills does; the two builds take turns round by round and each keeps its
median of --rounds. Their outputs must agree to --tolerance (0: bit for bit).

    python benchmarks/cpu/prefill_attention_revs.py --baseline-rev HEAD [--rounds 9]
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
from revision_build import build_library, build_revision

HEADS, KV_HEADS, HEAD_DIM, BLOCK, STEP_TOKENS = 9, 3, 64, 16, 512
SOURCES = ["pagedlm/csrc/prefill_attention_cpu.cpp", "pagedlm/csrc/prefill_attention_cpu.h",
           "pagedlm/csrc/cpu_vec.h"]


def prompt_lengths() -> list[int]:
    from pagedlm.benchmarks.cli import SPEC_DECODE_MAX_OUTPUT_LEN
    from pagedlm.benchmarks.datasets import load_sharegpt_records
    from pagedlm.benchmarks.spec_decode import batch1_workloads, chat_ids
    from pagedlm.loader.gguf_loader import default_model_path
    from pagedlm.loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    workloads = batch1_workloads(tokenizer, 16, 0, SPEC_DECODE_MAX_OUTPUT_LEN, load_sharegpt_records())
    return [len(chat_ids(tokenizer, r.prompt)) for requests in workloads.values() for r in requests]


def chunk_calls(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[tuple]]:
    """The caches and one call per 512-token chunk: (q, block table, query_start, seq_lens)."""
    g = torch.Generator().manual_seed(0)
    blocks = [(n + BLOCK - 1) // BLOCK for n in lengths]
    k_cache = torch.randn(sum(blocks), BLOCK, KV_HEADS, HEAD_DIM, generator=g).half()
    v_cache = torch.randn(sum(blocks), BLOCK, KV_HEADS, HEAD_DIM, generator=g).half()
    calls, first = [], 0
    for n, nb in zip(lengths, blocks):
        table = torch.arange(first, first + nb).view(1, nb)
        first += nb
        for start in range(0, n, STEP_TOKENS):
            end = min(n, start + STEP_TOKENS)
            calls.append((torch.randn(end - start, HEADS, HEAD_DIM, generator=g), table, [0, end - start], [end]))
    return k_cache, v_cache, calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-rev", required=True)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--tolerance", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lengths = prompt_lengths()
    k_cache, v_cache, calls = chunk_calls(lengths)
    scale = HEAD_DIM**-0.5
    with tempfile.TemporaryDirectory() as tree_dir, tempfile.TemporaryDirectory() as rev_dir:
        kernels = {"tree": build_library("llama_decode_cpu", Path(tree_dir), f"pagedlm_prefill_tree_{time.time_ns()}"),
                   args.baseline_rev: build_revision(args.baseline_rev, SOURCES, Path(rev_dir))}

        def run(m) -> list[torch.Tensor]:
            return [m.paged_prefill(q, k_cache, v_cache, t, qs, sl, scale, 0) for q, t, qs, sl in calls]

        outs = [run(m) for m in kernels.values()]
        diff = max((a - b).abs().max().item() for a, b in zip(*outs))
        assert diff <= args.tolerance, f"the kernels' outputs differ by {diff:.3g}"
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for r in range(args.rounds + 1):
            order = list(kernels.items()) if r % 2 else list(kernels.items())[::-1]
            for name, m in order:
                start = time.perf_counter()
                run(m)
                if r:  # the first round warms up
                    times[name].append(time.perf_counter() - start)
    med = {name: sorted(t)[len(t) // 2] * 1e3 for name, t in times.items()}
    print(f"{len(lengths)} prompts ({sum(lengths)} tokens, longest {max(lengths)}) in {len(calls)} chunks of "
          f"<= {STEP_TOKENS}, one layer: " + "  ".join(f"{name} {ms:.1f} ms" for name, ms in med.items())
          + f"  {args.baseline_rev} / tree = {med[args.baseline_rev] / med['tree']:.2f}x (max |diff| {diff:.1e})")


if __name__ == "__main__":
    main()
