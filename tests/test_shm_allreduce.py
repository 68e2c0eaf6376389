"""The shared-memory all-reduce and all-gather (csrc/shm_allreduce_cpu.cpp) against gloo's,
between real processes: the same sums (to float rounding, bit-identical on every rank) and
the same gathered bits, across chunk boundaries and many rounds of both kinds; a rank that
never arrives makes the others raise, not hang."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
from datetime import timedelta

import pytest

from pagedlm.csrc import load_extension

pytestmark = pytest.mark.skipif(load_extension("shm_allreduce_cpu") is None,
                                reason="no C++ compiler for the kernel")

SHAPES = [(1, 576), (7, 64), (3, 1000), (5000,), (2, 2501)]  # 5000 > the chunk of 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, path, out):
    import torch
    import torch.distributed as dist

    from pagedlm.layers.parallel_state import ShmAllReduce

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    comm = ShmAllReduce(path, rank, world, chunk=1024)
    results = []
    for step in range(3):  # rounds keep counting across calls and shapes
        for i, shape in enumerate(SHAPES):
            g = torch.Generator().manual_seed(1000 * step + 10 * i + rank)
            x = torch.randn(shape, generator=g) * (rank + 1)
            ref = x.clone()
            dist.all_reduce(ref)
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x)
            gathered = comm.gather(x)
            assert all(torch.equal(a, b) for a, b in zip(gathered.unbind(0), parts))
            comm(x)
            results.append((x.numpy(), ref.numpy()))  # torch tensors would cross as fds
    out.put((rank, results))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_shm_all_reduce_equals_gloo_and_is_identical_on_every_rank(world):
    from pagedlm.layers.parallel_state import shm_segment_bytes

    fd, path = tempfile.mkstemp(prefix="pagedlm-test-", dir="/dev/shm")
    os.ftruncate(fd, shm_segment_bytes(world, 1024))
    os.close(fd)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, path, out)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        results = dict(out.get(timeout=120) for _ in range(world))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        os.unlink(path)
    import torch

    for rank in range(world):
        for (x, ref), (x0, _) in zip(results[rank], results[0]):
            torch.testing.assert_close(torch.from_numpy(x), torch.from_numpy(ref), rtol=1e-6,
                                       atol=1e-5)
            assert (x == x0).all()  # the same bits on every rank


def test_a_missing_rank_raises_instead_of_hanging():
    import torch

    from pagedlm.layers.parallel_state import ShmAllReduce, shm_segment_bytes

    fd, path = tempfile.mkstemp(prefix="pagedlm-test-", dir="/dev/shm")
    os.ftruncate(fd, shm_segment_bytes(2, 64))
    os.close(fd)
    try:
        comm = ShmAllReduce(path, 0, 2, chunk=64, timeout_ms=200)
        with pytest.raises(RuntimeError, match="rank 1 did not reach round 1"):
            comm(torch.ones(10))
    finally:
        os.unlink(path)
