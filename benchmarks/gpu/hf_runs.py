"""The HF transformers baselines of run_all.py's throughput phase, on a model already built:
static batching (pagedlm.benchmarks.hf_baseline) and continuous batching
(`init_continuous_batching`, the manager behind `generate_batch`)."""

from __future__ import annotations

import time
from typing import Any


class OnDevice:
    """A tokenizer whose encodings land on `device` (the HF baseline encodes on the host)."""

    def __init__(self, inner: Any, device: str) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_device", device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)

    def __call__(self, *a: Any, **kw: Any) -> dict:
        return {k: v.to(self._device) for k, v in self._inner(*a, **kw).items()}


def hf_static_throughput(model: Any, requests: list, eos_token_id: int, max_batch_size: int,
                         device: str) -> dict:
    import torch

    from pagedlm.benchmarks.hf_baseline import run_hf_static
    from pagedlm.benchmarks.throughput import PretokenizedPrompts

    tok = OnDevice(PretokenizedPrompts(requests, eos_token_id), device)
    reqs = tok.requests(requests)
    with torch.inference_mode():
        return run_hf_static(model, tok, reqs, max_batch_size=max_batch_size, num_threads=None,
                             use_tqdm=False)


def hf_cb_throughput(model: Any, requests: list) -> dict:
    from transformers import GenerationConfig

    from pagedlm.benchmarks.throughput import throughput_figures

    prompt_tokens = sum(r.prompt_len for r in requests)
    gen = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0,
                           max_new_tokens=max(r.output_len for r in requests),
                           eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    start = time.perf_counter()
    for i, r in enumerate(requests):
        manager.add_request(r.prompt_token_ids, request_id=str(i), max_new_tokens=r.output_len)
    generated = 0
    for _ in requests:
        result = manager.get_result(timeout=600)
        generated += len(result.generated_tokens)
    elapsed = time.perf_counter() - start
    manager.stop(block=True)
    return throughput_figures(elapsed, len(requests), prompt_tokens, generated)
