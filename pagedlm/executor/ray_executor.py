"""Tensor parallelism across machines: ranks as Ray actors on an existing Ray cluster.

    machine A: ray start --head --port 6379          machine B: ray start --address A:6379
    machine A: pagedlm serve --tensor-parallel-size 2 --distributed-executor-backend ray

A placement group reserves one bundle per rank (CPUs, or a GPU) over the cluster's nodes,
packed onto as few nodes as fit; each rank is an actor in its bundle. Rank 0's node
hosts the torch.distributed rendezvous (gloo on CPU, NCCL on GPUs). Each step the engine
puts the SchedulerOutput in Ray's object store once and every rank reads it; only rank 0
samples and only its result comes back (see executor/multiproc.py).

Faults: an actor that dies or raises makes `ray.get` raise; the executor then kills every
rank's actor (a peer may be blocked in a collective), frees the placement group and
raises `WorkerError`. The cluster itself is the user's: it is never stopped here.
"""

from __future__ import annotations

import logging
import os
import socket

from pagedlm.config import EngineArgs
from pagedlm.core.sched_output import SchedulerOutput
from pagedlm.executor.base import RankedExecutor
from pagedlm.executor.multiproc import WorkerError
from pagedlm.executor.worker_proc import init_worker

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 60.0
_STARTUP_TIMEOUT_S = 600.0


class RayWorker:
    """One rank, as a Ray actor (`ray.remote` is applied when the executor starts)."""

    def __init__(self) -> None:
        self.worker = None
        self.rank = 0

    def node_address(self) -> tuple[str, int]:
        """This node's address and a port free on it, for the rendezvous."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def init(self, args: EngineArgs, rank: int, world_size: int, master_addr: str,
             port: int, env: dict[str, str]) -> None:
        os.environ.update(env)
        self.rank = rank
        # Ray gives each actor its own GPU (CUDA_VISIBLE_DEVICES): device 0 is it.
        self.worker = init_worker(args, rank, world_size, master_addr, port, None,
                                  local_rank=0)

    def call(self, method: str, *method_args):
        result = getattr(self.worker, method)(*method_args)
        return result if self.rank == 0 or method != "execute_model" else None


class RayExecutor(RankedExecutor):
    def __init__(self, args: EngineArgs) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group, remove_placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ValueError("distributed_executor_backend='ray' needs Ray: "
                             "pip install -e '.[ray]'") from None
        self._ray = ray
        self._remove_placement_group = remove_placement_group
        self.world_size = args.tensor_parallel_size
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS", "auto")
            try:
                ray.init(address=address, logging_level=logging.WARNING,
                         log_to_driver=True)
            except ConnectionError as e:
                raise ValueError(
                    f"no Ray cluster at {address!r} ({e}); start one with `ray start --head` "
                    "(and `ray start --address=HEAD:PORT` on the other machines), or set "
                    "RAY_ADDRESS") from None
        use_gpu = args.device == "cuda" or (args.device == "auto" and _cluster_gpus(ray) > 0)
        cpus = max(1, args.num_threads or 1)
        bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": cpus}
        self.placement_group = placement_group([dict(bundle)] * self.world_size,
                                               strategy="PACK")
        ready, _ = ray.wait([self.placement_group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(self.placement_group)
            raise ValueError(
                f"the Ray cluster cannot place {self.world_size} ranks of {bundle} within "
                f"{_PLACEMENT_TIMEOUT_S:.0f} s (it has {ray.cluster_resources()}); add nodes or "
                "lower --tensor-parallel-size / --num-threads")
        actor_cls = ray.remote(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0))(RayWorker)
        self.actors = [
            actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=rank)).remote()
            for rank in range(self.world_size)
        ]
        self._failed: str | None = None
        master_addr, port = self._get([self.actors[0].node_address.remote()], "start-up")[0]
        env = {k: v for k, v in os.environ.items()
               if k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "PAGEDLM_DISABLE_CPU_KERNELS")}
        self._get([actor.init.remote(args, rank, self.world_size, master_addr, port, env)
                   for rank, actor in enumerate(self.actors)], "start-up",
                  timeout=_STARTUP_TIMEOUT_S)
        self.node_ids = self._get([a.node_id.remote() for a in self.actors], "start-up")
        logger.info("tensor parallel over Ray: %d ranks on %d node(s), rendezvous %s:%d",
                    self.world_size, len(set(self.node_ids)), master_addr, port)

    def _get(self, refs: list, what: str, timeout: float | None = None) -> list:
        ray = self._ray
        if self._failed is not None:
            raise WorkerError(f"the tensor-parallel workers stopped earlier: {self._failed}")
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(e.cause, Exception) else None
            if isinstance(cause, ValueError) and what == "start-up":
                self._fail(str(cause), ValueError)
            self._fail(f"a rank failed in {what}: {e}")
        except ray.exceptions.RayActorError as e:
            self._fail(f"a rank died during {what}: {e}")
        except ray.exceptions.GetTimeoutError:
            self._fail(f"no answer from the ranks within {timeout:.0f} s ({what})")

    def _fail(self, message: str, error: type[Exception] = WorkerError):
        self._failed = message
        if error is WorkerError:
            logger.error("tensor-parallel worker failure: %s", message)
        self.shutdown()
        raise error(message)

    def _call(self, method: str, *args) -> list:
        """Run `method` on every rank; returns each rank's result."""
        return self._get([actor.call.remote(method, *args) for actor in self.actors], method)

    def _step_message(self, sched: SchedulerOutput) -> object:
        return self._ray.put(sched)  # serialised once, read by every rank

    def shutdown(self) -> None:
        ray = self._ray
        for actor in getattr(self, "actors", []):
            try:
                ray.kill(actor)
            except Exception:
                pass
        self.actors = []
        if getattr(self, "placement_group", None) is not None:
            try:
                self._remove_placement_group(self.placement_group)
            except Exception:
                pass
            self.placement_group = None


def _cluster_gpus(ray) -> float:
    return ray.cluster_resources().get("GPU", 0)
