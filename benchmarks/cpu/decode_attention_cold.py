"""The C++ paged decode kernel as a decode step meets it: 30 layers of SmolLM2-sized float16
caches (5825 blocks of 16 tokens each), so every layer's K/V comes from DRAM, not from a cache
the previous call warmed; sequences on scattered blocks (random block tables) or, with
--contiguous, on consecutive ones.

    python benchmarks/cpu/decode_attention_cold.py [--contiguous]
"""

import argparse
import time

import torch

from pagedlm.attention.cpu_kernels import paged_decode_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, LAYERS = 9, 3, 64, 16, 5825, 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contiguous", action="store_true", help="consecutive blocks per sequence")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half())
              for _ in range(LAYERS)]
    for seqs, ctx in [(48, 370), (4, 900)]:
        per = ctx // BLOCK + 1
        if args.contiguous:
            tables = torch.arange(1, seqs * per + 1).view(seqs, per)
        else:
            tables = (torch.randperm(NUM_BLOCKS - 1, generator=g)[: seqs * per] + 1).view(seqs, per)
        q = torch.randn(seqs, HEADS, HEAD_DIM)
        lens = [ctx] * seqs
        times = []
        for _ in range(8):
            start = time.perf_counter()
            for k, v in caches:
                paged_decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5)
            times.append(time.perf_counter() - start)
        median = sorted(times[1:])[3]
        gigabytes = LAYERS * seqs * ctx * KV_HEADS * HEAD_DIM * 2 * 2 / 1e9
        print(f"{seqs} seqs x {ctx} tokens, {LAYERS} layers: {median * 1e3:.1f} ms per step, "
              f"{gigabytes / median:.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
