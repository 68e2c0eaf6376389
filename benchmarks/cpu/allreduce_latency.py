"""Latency of one tensor-parallel all-reduce on this machine: gloo over 127.0.0.1 between
N processes, one thread and one core each (as `--tensor-parallel-size N` runs them), for
the tensors a decoder layer reduces: [rows, hidden] float32 after o_proj and down_proj.

    python benchmarks/cpu/allreduce_latency.py [--world-size 2] [--hidden 576]
           [--rows 1 8 64 512] [--iters 2000]

SmolLM2-135M has hidden 576 and 30 layers, so a step makes 60 of these calls.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from datetime import timedelta


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world_size: int, port: int, hidden: int, rows: list[int], iters: int, out):
    import torch
    import torch.distributed as dist

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= world_size:
        os.sched_setaffinity(0, [cores[rank]])
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    results = {}
    for n in rows:
        x = torch.randn(n, hidden)
        for _ in range(50):
            dist.all_reduce(x)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        results[n] = (time.perf_counter() - start) / iters
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main() -> None:
    import multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.world_size, port, args.hidden, args.rows,
                                             args.iters, out))
             for r in range(args.world_size)]
    for proc in procs:
        proc.start()
    results = out.get(timeout=600)
    for proc in procs:
        proc.join()
    print(f"gloo all_reduce, {args.world_size} processes on 127.0.0.1, float32 [rows, {args.hidden}]")
    for n, seconds in results.items():
        print(f"  rows {n:5d}: {1e6 * seconds:8.1f} us per call")


if __name__ == "__main__":
    main()
