"""The KV-sizing profile step (on CUDA, before the cache exists) on CPU.

On a GPU the engine sizes its KV cache by running one forward pass at the largest step
it will schedule. That pass fabricates prompts; they must stay within the context the
engine serves (max_model_len), or their positions run past the rotary tables the model
was built with (a device-side assert on CUDA, seen on an H200 with max_model_len below
the model's context). The same step runs here, where an index error is immediate.
"""

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.worker import worker as worker_mod


@pytest.fixture
def profiled(monkeypatch):
    """Worker.determine_num_blocks runs the profile step on CPU, recording its shape."""
    calls = []
    original = worker_mod.Worker.determine_num_blocks

    def determine(self, max_batched, max_model_len):
        calls.append((max_batched, max_model_len))
        self.run_profile_step(max_batched, max_model_len)
        return original(self, max_batched, max_model_len)

    monkeypatch.setattr(worker_mod.Worker, "determine_num_blocks", determine)
    return calls


@pytest.mark.parametrize("max_model_len,max_batched", [(64, 256), (200, 256), (512, 128)])
def test_profile_step_stays_within_max_model_len(tiny_llama_dir, profiled, max_model_len,
                                                 max_batched):
    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, max_model_len=max_model_len,
              max_num_batched_tokens=max_batched, max_num_seqs=4, kv_cache_memory=1 << 22,
              enforce_eager=True)
    assert profiled == [(max_batched, max_model_len)]
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    assert not runner.input_batch.row_of  # the fabricated requests are gone again
    out = llm.generate({"prompt_token_ids": [1, 2, 3]},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_kv_blocks_in_budget():
    from pagedlm.worker.kv_cache import kv_blocks_in_budget

    gib = 1 << 30
    # 100 GiB card, 4 GiB used by another process, this one reserved 20 GiB and peaked
    # at 18 GiB (weights and activations): 90 - 4 - 18 = 68 GiB for the cache.
    assert kv_blocks_in_budget(100 * gib, 76 * gib, 20 * gib, 18 * gib, gib, 0.9) == 68
    assert kv_blocks_in_budget(100 * gib, 80 * gib, 20 * gib, 18 * gib, gib, 0.9) == 72
    assert kv_blocks_in_budget(100 * gib, 10 * gib, 20 * gib, 18 * gib, gib, 0.9) == 2
    assert kv_blocks_in_budget(100 * gib, 80 * gib, 20 * gib, 95 * gib, gib, 0.9) == 0


def test_cuda_sizing_leaves_room_for_the_weights(tiny_llama_dir, monkeypatch):
    """The profile on a (simulated) card: weights + activations at the peak + the cache
    stay within gpu_memory_utilization of it. Counting the weights out of the peak once let
    the cache take their room, and an 8B model ran out of memory on an H200."""
    import torch

    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, max_model_len=128, max_num_seqs=4,
              kv_cache_memory=1 << 22, enforce_eager=True, gpu_memory_utilization=0.5)
    worker = llm.llm_engine.core.model_executor.driver_worker
    weights = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    total, others, activations = 64 << 20, 3 << 20, 2 << 20
    reserved = weights + activations + (1 << 20)
    fake = {"reset_peak_memory_stats": lambda *a: None, "synchronize": lambda *a: None,
            "empty_cache": lambda *a: None,
            "max_memory_allocated": lambda *a: weights + activations,
            "mem_get_info": lambda *a: (total - others - reserved, total),
            "memory_reserved": lambda *a: reserved}
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    block_bytes = worker.worker_spec().block_bytes
    blocks = worker._profile_cuda_blocks(block_bytes, 256, 128)
    room = 0.5 * total - others - weights - activations
    assert 0 < blocks and room - block_bytes < blocks * block_bytes <= room
