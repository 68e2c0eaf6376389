"""A step's prefill attention on CPU as the engine computes it, SmolLM2's 9 query / 3 kv heads
of 64 dims, float16 cache: the torch backend (one SDPA call per sequence, torch_paged.py)
against the C++ kernel (every sequence in one call, csrc/prefill_attention_cpu.cpp), on the
prompt lengths of the ShareGPT workload of `pagedlm bench throughput` (64 requests, seed 0),
cut into steps of about --step-tokens new tokens as the scheduler's token budget cuts them.
The two run interleaved, step by step, each keeping its best of --rounds; results must agree.

    python benchmarks/cpu/prefill_attention.py [--num-prompts 64] [--step-tokens 2048]
"""

import argparse
import time

import torch

from pagedlm.attention.cpu_kernels import paged_prefill_attention
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.attention.torch_paged import TorchPagedAttention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def prompt_lengths(num_prompts: int) -> list[int]:
    from pagedlm.benchmarks.datasets import sample_sharegpt
    from pagedlm.loader.gguf_loader import default_model_path
    from pagedlm.loader.tokenizer import load_tokenizer

    return [r.prompt_len for r in sample_sharegpt(load_tokenizer(default_model_path()), num_prompts, seed=0)]


def steps_of(lengths: list[int], budget: int) -> list[list[int]]:
    steps, cur = [], []
    for n in lengths:
        if cur and sum(cur) + n > budget:
            steps.append(cur)
            cur = []
        cur.append(n)
    return steps + [cur] if cur else steps


def one_step(lengths: list[int], rounds: int) -> tuple[float, float, float]:
    g = torch.Generator().manual_seed(len(lengths))
    blocks_per = [(n + BLOCK - 1) // BLOCK for n in lengths]
    max_blocks = max(blocks_per)
    num_blocks = sum(blocks_per) + 1
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).half()
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).half()
    tables = torch.zeros(len(lengths), max_blocks, dtype=torch.int64)
    first = 1
    for r, nb in enumerate(blocks_per):
        tables[r, :nb] = torch.arange(first, first + nb)
        first += nb
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    total = starts[-1]
    q = torch.randn(total, HEADS, HEAD_DIM, generator=g)
    key = torch.empty(total, KV_HEADS, HEAD_DIM)  # the torch path reads the keys from here
    value = torch.empty(total, KV_HEADS, HEAD_DIM)
    for r, n in enumerate(lengths):
        pos = torch.arange(n)
        slots = tables[r, pos // BLOCK] * BLOCK + pos % BLOCK
        key[starts[r]:starts[r + 1]] = k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots].float()
        value[starts[r]:starts[r + 1]] = v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots].float()
    meta = AttentionMetadata(
        num_decodes=0, num_decode_tokens=0, num_prefills=len(lengths), num_tokens=total,
        max_query_len=max(lengths), max_seq_len=max(lengths), query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(lengths), block_tables=tables, slot_mapping=torch.zeros(total, dtype=torch.int64),
        query_start_loc_cpu=starts, seq_lens_cpu=list(lengths),
    )
    backend, scale = TorchPagedAttention(), HEAD_DIM**-0.5

    def torch_path():
        out = torch.empty_like(q)
        for r in range(len(lengths)):
            out[starts[r]:starts[r + 1]] = backend._prefill(
                r, q, key, value, k_cache, v_cache, meta, scale, None, None, None)
        return out

    def kernel():
        return paged_prefill_attention(q, k_cache, v_cache, tables, starts, lengths, scale)

    diff = (torch_path() - kernel()).abs().max().item()
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, fn in enumerate((torch_path, kernel)):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1], diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--step-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lengths = prompt_lengths(args.num_prompts)
    totals = [0.0, 0.0]
    for lens in steps_of(lengths, args.step_tokens):
        t_torch, t_kernel, diff = one_step(lens, args.rounds)
        assert diff < 1e-3, f"results differ by {diff}"
        totals[0] += t_torch
        totals[1] += t_kernel
        print(f"step of {len(lens):2d} prompts, {sum(lens):5d} tokens (longest {max(lens):4d}): "
              f"torch SDPA {t_torch * 1e3:7.2f} ms  kernel {t_kernel * 1e3:7.2f} ms  "
              f"{t_torch / t_kernel:.2f}x  (max |diff| {diff:.1e})", flush=True)
    print(f"all steps, one layer: torch SDPA {totals[0] * 1e3:.1f} ms, kernel {totals[1] * 1e3:.1f} ms, "
          f"{totals[0] / totals[1]:.2f}x; x 30 layers: {30 * (totals[0] - totals[1]):.2f} s saved")


if __name__ == "__main__":
    main()
