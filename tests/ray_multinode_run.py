"""Run inside a fresh network namespace (loopback only) by tests/test_ray_executor.py: a
two-node Ray cluster on this machine, tensor parallelism 2 across its nodes, then a rank
killed mid-generation. Writes what it saw as JSON to argv[2]."""

import json
import os
import signal
import sys
import time

import ray
from ray.cluster_utils import Cluster

from pagedlm import LLM, SamplingParams
from pagedlm.executor import WorkerError

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42], list(range(60, 90))]


def main() -> None:
    path, out_path = sys.argv[1], sys.argv[2]
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING")
    result = {"nodes": len(ray.nodes())}
    llm = LLM(path, skip_tokenizer_init=True, block_size=4, kv_cache_memory=1 << 22,
              tensor_parallel_size=2, distributed_executor_backend="ray", num_threads=1)
    executor = llm.llm_engine.model_executor
    result["node_ids"] = executor.node_ids
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    result["tokens"] = [o.outputs[0].token_ids for o in outs]
    seeded = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], seeded, use_tqdm=False)
    result["sampled"] = [[c.token_ids for c in o.outputs] for o in outs]

    engine = llm.llm_engine
    pid = ray.get(executor.actors[1].pid.remote())
    engine.add_request("long", None, SamplingParams(max_tokens=400, ignore_eos=True),
                       prompt_token_ids=PROMPTS[0])
    engine.step()
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    try:
        for _ in range(400):
            engine.step()
        result["error"] = None
    except WorkerError as e:
        result["error"] = str(e)
    result["error_after_s"] = time.monotonic() - start
    result["actors_left"] = len(executor.actors)
    with open(out_path, "w") as f:
        json.dump(result, f)
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()
