"""The C++ CPU paged decode kernel per layer call: 32 sequences x 500 tokens, SmolLM2's
heads, float32 / float16 / bfloat16 caches, 1 and 2 threads.

    python benchmarks/cpu/decode_attention.py
"""

import time

import torch

from pagedlm.attention.cpu_kernels import paged_decode_attention

SEQS, HEADS, KV_HEADS, HEAD_DIM, BLOCK, CTX = 32, 9, 3, 64, 16, 500


def time_call(dtype: torch.dtype) -> float:
    num_blocks = SEQS * (CTX // BLOCK + 1) + 1
    k = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    v = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    block_tables = torch.arange(1, num_blocks).view(SEQS, -1)
    q = torch.randn(SEQS, HEADS, HEAD_DIM)
    lens = [CTX] * SEQS
    paged_decode_attention(q, k, v, block_tables, lens, 0.125)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(20):
            paged_decode_attention(q, k, v, block_tables, lens, 0.125)
        best = min(best, (time.perf_counter() - start) / 20)
    return best


def main() -> None:
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            t = time_call(dtype)
            megabytes = SEQS * CTX * KV_HEADS * HEAD_DIM * 2 * torch.empty((), dtype=dtype).element_size() / 1e6
            print(f"threads={threads} {dtype}: {SEQS} seqs x {CTX} tokens: {t * 1e3:.3f} ms per "
                  f"layer call, {megabytes / t / 1e3:.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
