"""Tensor parallelism across the nodes of a Ray cluster: a real two-node cluster on this
machine, inside a network namespace of its own whose only address is 127.0.0.1 (Ray binds
to the machine's interface address otherwise), with usage stats and the dashboard off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedlm import LLM, SamplingParams
from tests.ray_multinode_run import PROMPTS

pytest.importorskip("ray")


def _can_unshare() -> bool:
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not _can_unshare(), reason="needs `unshare -n` (root, util-linux)")
def test_two_node_ray_cluster_tp2_equals_one_process(tiny_llama_dir, tmp_path):
    one = LLM(tiny_llama_dir, skip_tokenizer_init=True, block_size=4, kv_cache_memory=1 << 22,
              num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in
                one.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    seeded = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    expected_sampled = [[c.token_ids for c in o.outputs] for o in
                        one.generate([{"prompt_token_ids": p} for p in PROMPTS], seeded,
                                     use_tqdm=False)]
    out = tmp_path / "result.json"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(root),
           "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    script = (f"ip link set lo up && exec {sys.executable} -m tests.ray_multinode_run "
              f"{tiny_llama_dir} {out}")
    proc = subprocess.run(["unshare", "-n", "--", "bash", "-c", script], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(out.read_text())
    assert result["nodes"] == 2
    assert len(set(result["node_ids"])) == 2, "both ranks landed on one node"
    assert result["tokens"] == expected
    assert result["sampled"] == expected_sampled
    assert result["error"] is not None and "died" in result["error"], result["error"]
    assert result["error_after_s"] < 10
    assert result["actors_left"] == 0
