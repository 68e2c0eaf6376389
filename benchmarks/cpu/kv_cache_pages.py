"""The paged decode kernel on the engine's KV cache memory (2 MB pages where the kernel
grants them, worker/kv_cache.py) against the same caches in torch's 4 KB pages, taking
turns step by step in one process: 30 layers of SmolLM2-sized float16 caches (5825 blocks
of 16 tokens), sequences on scattered blocks, as a long-running server's free block queue
leaves them.

    python benchmarks/cpu/kv_cache_pages.py [--threads 2] [--steps 9]
"""

import argparse
import time

import torch

from pagedlm.attention.cpu_kernels import load_cpu_kernels
from pagedlm.worker.kv_cache import allocate_kv_cache

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, LAYERS = 9, 3, 64, 16, 5825, 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=9, help="timed steps per memory kind (median reported)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the CPU attention kernels are not available")
    g = torch.Generator().manual_seed(0)
    caches = {}
    for name, huge in (("4 KB pages", False), ("2 MB pages", True)):
        layers = allocate_kv_cache(LAYERS, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, torch.float16,
                                   torch.device("cpu"), huge_pages=huge)
        for k, v in layers:
            k.copy_(torch.randn(k.shape, generator=g))
            v.copy_(torch.randn(v.shape, generator=g))
        caches[name] = layers
    huge_kb = next((line.split()[1] for line in open("/proc/self/smaps_rollup")
                    if line.startswith("AnonHugePages")), "?")
    print(f"AnonHugePages of this process: {huge_kb} kB")
    # (each row's context length, whether the rows are one sequence's verification)
    cases = [([370] * 48, False), (torch.linspace(900, 40, 48).int().tolist(), False),
             ([600 - r for r in range(7)], True)]
    for lens, one_sequence in cases:
        per = max(lens) // BLOCK + 1
        seqs = 1 if one_sequence else len(lens)
        tables = (torch.randperm(NUM_BLOCKS - 1, generator=g)[: seqs * per] + 1).view(seqs, per)
        tables = tables.expand(len(lens), per).contiguous() if one_sequence else tables
        q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=g) * HEAD_DIM**-0.5
        times: dict[str, list[float]] = {name: [] for name in caches}
        for step in range(args.steps + 1):
            for name, layers in caches.items():
                start = time.perf_counter()
                for k, v in layers:
                    kernels.paged_decode(q, k, v, tables, lens, 0.0, 0, None)
                if step:  # the first step of each is a warm-up
                    times[name].append(time.perf_counter() - start)
        med = {name: sorted(t)[len(t) // 2] * 1e3 for name, t in times.items()}
        small, huge = med["4 KB pages"], med["2 MB pages"]
        span = f"{lens[0]}" if min(lens) == max(lens) else f"{max(lens)}..{min(lens)}"
        print(f"{len(lens)} rows x {span} tokens, {LAYERS} layers: 4 KB pages {small:.1f} ms, "
              f"2 MB pages {huge:.1f} ms per step, {small / huge:.2f}x", flush=True)


if __name__ == "__main__":
    main()
