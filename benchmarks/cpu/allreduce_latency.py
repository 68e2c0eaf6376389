"""Latency of one tensor-parallel all-reduce on this machine, gloo over 127.0.0.1 against
the shared-memory all-reduce (csrc/shm_allreduce_cpu.cpp), between N processes with one
thread and one core each (as `--tensor-parallel-size N` runs them), for the tensors a
decoder layer reduces: [rows, hidden] float32 after o_proj and down_proj. Both results are
compared on every call size.

    python benchmarks/cpu/allreduce_latency.py [--world-size 2] [--hidden 576]
           [--rows 1 8 64 512] [--iters 2000]

SmolLM2-135M has hidden 576 and 30 layers, so a step makes 60 of these calls.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from datetime import timedelta


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world_size: int, port: int, hidden: int, rows: list[int], iters: int, out,
          shm_path: str):
    import torch
    import torch.distributed as dist

    from pagedlm.layers.parallel_state import ShmAllReduce

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= world_size:
        os.sched_setaffinity(0, [cores[rank]])
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    shm = ShmAllReduce(shm_path, rank, world_size)
    results = {}
    for n in rows:
        x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(rank))
        a, b = x.clone(), x.clone()
        dist.all_reduce(a)
        shm(b)
        max_diff = (a - b).abs().max().item()
        times = {}
        for name, fn in (("gloo", dist.all_reduce), ("shm", shm)):
            for _ in range(50):
                fn(x)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn(x)
            times[name] = (time.perf_counter() - start) / iters
        results[n] = (times["gloo"], times["shm"], max_diff)
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
    from pagedlm.layers.parallel_state import shm_segment_bytes

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    fd, shm_path = tempfile.mkstemp(prefix="pagedlm-bench-", dir="/dev/shm")
    os.ftruncate(fd, shm_segment_bytes(args.world_size))
    os.close(fd)
    procs = [ctx.Process(target=_rank, args=(r, args.world_size, port, args.hidden, args.rows,
                                             args.iters, out, shm_path))
             for r in range(args.world_size)]
    try:
        for proc in procs:
            proc.start()
        results = out.get(timeout=600)
        for proc in procs:
            proc.join()
    finally:
        os.unlink(shm_path)
    print(f"all_reduce, {args.world_size} processes (one core each), float32 [rows, {args.hidden}]")
    print(f"  {'rows':>5s} {'gloo us':>9s} {'shm us':>9s} {'gloo/shm':>9s} {'max |diff|':>11s}")
    for n, (gloo, shm, diff) in results.items():
        print(f"  {n:5d} {1e6 * gloo:9.1f} {1e6 * shm:9.1f} {gloo / shm:9.1f} {diff:11.2e}")


if __name__ == "__main__":
    main()
