"""The C++ paged decode kernel as a decode step meets it: 30 layers of SmolLM2-sized float16
caches (5825 blocks of 16 tokens each), so every layer's K/V comes from DRAM, not from a cache
the previous call warmed; sequences on scattered blocks (random block tables) or, with
--contiguous, on consecutive ones.

With --baseline-rev REV the kernel source of that git revision is built too and the two run
interleaved, step by step, in one process: on a shared VM whose speed drifts by more than
the difference between two kernels, only such a side-by-side comparison means anything.
With --verify-rows K, the batches are speculative verifications of K rows per sequence
instead (k + 1 rows sharing a sequence's blocks, longest first).

    python benchmarks/cpu/decode_attention_cold.py [--contiguous] [--baseline-rev b33ca28]
        [--verify-rows 7] [--small-pages]
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
from revision_build import build_revision

from pagedlm.attention.cpu_kernels import load_cpu_kernels
from pagedlm.worker.kv_cache import allocate_kv_cache

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, LAYERS = 9, 3, 64, 16, 5825, 30
SOURCES = ["pagedlm/csrc/paged_attention_cpu.cpp", "pagedlm/csrc/cpu_vec.h"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contiguous", action="store_true", help="consecutive blocks per sequence")
    p.add_argument("--block-size", type=int, default=BLOCK, help="tokens per cache block (the same tokens in all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--baseline-rev", help="also time the kernel of this git revision, interleaved")
    p.add_argument("--small-pages", action="store_true",
                   help="caches in 4 KB pages (torch.zeros), not the engine's 2 MB pages")
    p.add_argument("--verify-rows", type=int, default=0,
                   help="instead of the decode batches, speculative verifications of this many rows per sequence")
    p.add_argument("--steps", type=int, default=9, help="timed steps per kernel (median reported)")
    p.add_argument("--tolerance", type=float, default=0.0,
                   help="largest difference allowed between the kernels' outputs (default: equal; "
                        "a kernel that sums in another order needs some)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernels = {"current": load_cpu_kernels()}
    if kernels["current"] is None:
        raise SystemExit("the CPU attention kernels are not available")
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline_rev:
            kernels[args.baseline_rev] = build_revision(args.baseline_rev, SOURCES, Path(tmp))
        run(kernels, args)


def run(kernels: dict, args: argparse.Namespace) -> None:
    g = torch.Generator().manual_seed(0)
    block = args.block_size
    num_blocks = NUM_BLOCKS * BLOCK // block
    # The engine's cache memory (worker/kv_cache.py: 2 MB pages where the kernel grants
    # them), or with --small-pages plain tensors in 4 KB pages.
    caches = allocate_kv_cache(LAYERS, num_blocks, block, KV_HEADS, HEAD_DIM, torch.float16,
                               torch.device("cpu"), huge_pages=not args.small_pages)
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    # (sequences, their context lengths): equal lengths, and a spread as a real batch has,
    # longest first (the order the model runner gives the kernel).
    cases = [(48, [370] * 48), (4, [900] * 4), (48, torch.linspace(900, 40, 48).int().tolist())]
    if args.verify_rows:
        # Speculative verifications: each sequence's k + 1 rows share its blocks and end at
        # consecutive positions, longest first (the model runner's order).
        rows = args.verify_rows
        cases = [(seqs, [n - r for n in ends for r in range(rows)])
                 for seqs, ends in [(1, [200]), (1, [600]), (1, [1500]), (4, [700, 500, 300, 100])]]
    for seqs, lens in cases:
        ctx = max(lens)
        per = ctx // block + 1
        if args.contiguous:
            tables = torch.arange(1, seqs * per + 1).view(seqs, per)
        else:
            tables = (torch.randperm(num_blocks - 1, generator=g)[: seqs * per] + 1).view(seqs, per)
        if len(lens) > seqs:  # a verification's rows: each sequence's table once per row
            tables = tables.repeat_interleave(len(lens) // seqs, dim=0)
            seqs = len(lens)
        # The kernel's own input: float32 queries already multiplied by the softmax scale.
        q = torch.randn(seqs, HEADS, HEAD_DIM, generator=g) * HEAD_DIM**-0.5
        times: dict[str, list[float]] = {name: [] for name in kernels}
        outs = {name: module.paged_decode(q, *caches[0], tables, lens, 0.0, 0, None) for name, module in kernels.items()}
        first = next(iter(outs.values()))
        diff = max((o - first).abs().max().item() for o in outs.values())
        assert diff <= args.tolerance, f"the kernels' outputs differ by {diff:.3g} (--tolerance)"
        for step in range(args.steps + 1):
            for name, module in kernels.items():
                start = time.perf_counter()
                for k, v in caches:
                    module.paged_decode(q, k, v, tables, lens, 0.0, 0, None)
                if step:  # the first step of each kernel is a warm-up
                    times[name].append(time.perf_counter() - start)
        # The cache bytes the step reads once each (a verification's rows share theirs).
        tokens = sum(lens[r] for r in range(len(lens)) if r + 1 == len(lens) or not torch.equal(tables[r], tables[r + 1]))
        gigabytes = LAYERS * tokens * KV_HEADS * HEAD_DIM * 2 * 2 / 1e9
        medians = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
        span = f"{lens[0]}" if min(lens) == max(lens) else f"{max(lens)}..{min(lens)}"
        line = f"{seqs} rows x {span} tokens, {LAYERS} layers:"
        for name, median in medians.items():
            line += f"  {name} {median * 1e3:.1f} ms per step ({gigabytes / median:.1f} GB/s)"
        if len(medians) == 2:
            line += f"  baseline / current = {medians[args.baseline_rev] / medians['current']:.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
