"""HF transformers continuous batching baseline (``init_continuous_batching``), on CPU.

Every request is added to one continuous-batching manager with its own ``max_new_tokens``
(``generate_batch`` takes one for all, so every request would run to the longest) and
``eos_token_id=-1`` to ignore EOS. The manager's background thread schedules the requests
over paged KV blocks, and each finished request's ``generated_tokens`` are counted.
Sampling: temperature 1, top-p 1, top-k off.

What makes it slow on CPU (transformers 5.23, SmolLM2-135M in fp32, 2 cores, py-spy):

* **Flattened attention.** Flash attention does not run on CPU, which leaves ``sdpa`` and
  ``paged|eager``. Both run a step's batch as one flattened sequence. The step gathers the
  KV of *all* its requests from the paged cache into one stretch of ``num_kv_tokens``,
  repeats it to the query heads (GQA 9/3: ``repeat_kv`` copies it 3x), and attends the
  step's ``num_q_tokens`` queries to all of it. A block-diagonal
  [num_q_tokens, num_kv_tokens + num_q_tokens] mask, filled every step, keeps requests
  apart. A decode step of B requests with L tokens of context therefore costs
  O(B * B * L) in attention and mask instead of O(B * L). Prefilling P prompt tokens in
  one step costs O(P * P) rather than O(sum of the squared prompt lengths). With 4
  requests, ``repeat_kv`` and SDPA already took 27% of the generation thread; the
  rest was the linear layers.
* **Defaults sized for a GPU.** With ``num_blocks`` and ``max_batch_tokens`` unset, the
  cache is sized from "free device memory", which on CPU is 90% of the host's RAM
  (psutil): about 20 GB here, ~450k token slots. ``max_batch_tokens`` defaults to 8192,
  so a burst of requests is prefilled in a few huge steps whose cost is quadratic in
  the step's size. 16 prompts of 384 tokens took 140 s in one 6144-token step, and
  63 s in 512-token steps (same loaded machine). ``generate_batch`` also takes one
  ``max_new_tokens`` for all requests.

This baseline therefore sizes the cache to the workload (:func:`plan_cache`), caps a step
at 512 tokens, and passes per-request lengths. ``max_requests_per_batch`` bounds the
B * B decode term. The first try's "64 requests not finished in 25 minutes" is mostly
the real cost of this design on CPU. The defaults made it worse: 8192-token prefill
steps, a RAM-sized cache, and one length for every request.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm import tqdm
from transformers import GenerationConfig

from pagedlm.benchmarks.datasets import SampleRequest

ATTN_IMPLEMENTATIONS = ("sdpa", "paged|eager")


@dataclass(frozen=True)
class HFCBConfig:
    """The continuous-batching knobs this baseline sets (``None``: transformers' default)."""

    attn_implementation: str = "sdpa"
    page_size: int = 64
    num_blocks: int | None = None  # None: enough for every request at once (plan_cache)
    max_batch_tokens: int | None = 512
    max_requests_per_batch: int | None = None

    def __post_init__(self) -> None:
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(f"--hf-cb-attn must be one of {', '.join(ATTN_IMPLEMENTATIONS)}, "
                             f"got {self.attn_implementation!r}")
        for name in ("page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"hf-cb {name} must be >= 1, got {value}")


def plan_cache(prompt_lens: Sequence[int], output_lens: Sequence[int], page_size: int) -> int:
    """Blocks of ``page_size`` tokens that hold every request's prompt and output at once
    (so the manager never has to evict), plus one spare block."""
    return sum(math.ceil((p + o) / page_size) for p, o in zip(prompt_lens, output_lens)) + 1


def cb_generation_config(ignore_eos: bool, eos_token_id: Any) -> Any:
    """Sampling as pagedlm's throughput benchmark does it: temperature 1, top-p 1, no top-k."""
    return GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                            eos_token_id=-1 if ignore_eos else eos_token_id,
                            max_new_tokens=1)


def run_hf_cb(model: Any, prompt_ids: Sequence[Sequence[int]],
              requests: Sequence[SampleRequest], config: HFCBConfig = HFCBConfig(),
              ignore_eos: bool = True, num_threads: int | None = None, seed: int = 0,
              use_tqdm: bool = True) -> dict[str, Any]:
    """Generate every request with HF continuous batching; count the tokens it produced.

    ``prompt_ids[i]`` is request ``i``'s prompt as token ids and ``requests[i].output_len``
    its ``max_new_tokens``.  Only generation is timed (the manager's set-up and a warm-up
    request are not).
    """
    # The hf-cb extra: transformers >= 5.17 (the base install asks for 4.45).
    from transformers import ContinuousBatchingConfig

    if len(prompt_ids) != len(requests):
        raise ValueError(f"{len(prompt_ids)} prompts for {len(requests)} requests")
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    if model.config._attn_implementation != config.attn_implementation:
        model.set_attn_implementation(config.attn_implementation)
    output_lens = [r.output_len for r in requests]
    num_blocks = config.num_blocks or plan_cache([len(p) for p in prompt_ids], output_lens,
                                                 config.page_size)
    cb_config = ContinuousBatchingConfig(
        page_size=config.page_size, num_blocks=num_blocks,
        max_batch_tokens=config.max_batch_tokens,
        max_requests_per_batch=config.max_requests_per_batch,
        auto_switch_to_flash=False, allow_block_sharing=False, use_cuda_graph=False,
        seed=seed,
    )
    eos = model.generation_config.eos_token_id if model.generation_config else None
    gen_config = cb_generation_config(ignore_eos, eos)
    manager = model.init_continuous_batching(generation_config=gen_config,
                                             continuous_batching_config=cb_config)
    manager.start()
    try:
        # Warm-up: one short request through the whole path, untimed.
        manager.add_request(list(prompt_ids[0]), request_id="warmup", max_new_tokens=2,
                            eos_token_id=gen_config.eos_token_id)
        _collect(manager, {"warmup"}, None)
        ids = [f"req_{i}" for i in range(len(requests))]
        pbar = tqdm(total=len(requests), desc="HF continuous batching", disable=not use_tqdm)
        start = time.perf_counter()
        for request_id, ids_i, out_len in zip(ids, prompt_ids, output_lens):
            manager.add_request(list(ids_i), request_id=request_id, max_new_tokens=out_len,
                                eos_token_id=gen_config.eos_token_id)
        results = _collect(manager, set(ids), pbar)
        elapsed = time.perf_counter() - start
        pbar.close()
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
        if hasattr(model, "destroy_cached_continuous_batching_manager"):
            model.destroy_cached_continuous_batching_manager()

    failed = [rid for rid, out in results.items() if out.error is not None]
    if failed:
        raise RuntimeError(f"HF continuous batching failed {len(failed)} requests, first: "
                           f"{results[failed[0]].error}")
    generated = sum(len(results[rid].generated_tokens) for rid in ids)
    prompt_tokens = sum(len(p) for p in prompt_ids)
    return {
        "elapsed_s": elapsed,
        "num_requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": generated,
        "requested_output_tokens": sum(output_lens),
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (prompt_tokens + generated) / elapsed,
        "hf_cb_config": {**asdict(config), "num_blocks": num_blocks},
    }


def _collect(manager: Any, pending: set[str], pbar: Any) -> dict[str, Any]:
    """Wait for every request in ``pending``; returns their final outputs by id."""
    results: dict[str, Any] = {}
    pending = set(pending)
    while pending:
        out = manager.get_result(timeout=1)
        if out is None:
            if not manager.is_running():
                raise RuntimeError("the HF continuous batching thread stopped with "
                                   f"{len(pending)} requests unfinished")
            continue
        if out.request_id in pending and out.is_finished():
            pending.discard(out.request_id)
            results[out.request_id] = out
            if pbar is not None:
                pbar.update(1)
    return results
