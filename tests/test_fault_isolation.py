"""Engine-level fault isolation: sampling each request apart (the path taken when the
batched sampler raises) gives exactly the batched tokens, and a request whose logits are
not finite ends with `error` while the others in its batch finish as usual."""

from __future__ import annotations

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.sample.sampler import Sampler
from pagedlm.worker.input_batch import InputBatch
from pagedlm.worker.model_runner import nonfinite_rows

PROMPTS = [{"prompt_token_ids": [5 + i, 17, 42, 99 - i, 7]} for i in range(6)]


def _params() -> list[SamplingParams]:
    # Greedy, seeded random, top-k/top-p, penalties and logprobs in one batch.
    return [
        SamplingParams(temperature=0, max_tokens=12, logprobs=3, detokenize=False),
        SamplingParams(temperature=0.8, seed=1, max_tokens=12, detokenize=False),
        SamplingParams(temperature=1.0, seed=2, top_k=20, top_p=0.9, max_tokens=12,
                       detokenize=False),
        SamplingParams(temperature=0.7, seed=3, repetition_penalty=1.3, presence_penalty=0.5,
                       max_tokens=12, logprobs=2, detokenize=False),
        SamplingParams(temperature=1.2, seed=4, min_p=0.05, min_tokens=4, max_tokens=12,
                       detokenize=False),
        SamplingParams(temperature=0.9, seed=5, n=2, max_tokens=12, detokenize=False),
    ]


def _llm(model_dir: str) -> LLM:
    return LLM(model_dir, skip_tokenizer_init=True, kv_cache_memory=8 << 20, max_model_len=256)


def _tokens(outputs) -> list:
    return [[(c.token_ids, [sorted(p) for p in c.logprobs or []]) for c in o.outputs]
            for o in outputs]


def test_sampling_apart_matches_the_batch(tiny_llama_dir, monkeypatch):
    llm = _llm(tiny_llama_dir)
    expected = llm.generate(PROMPTS, _params(), use_tqdm=False)
    original = Sampler.__call__
    apart = {"rows": 0}

    def batch_only_fails(self, logits, batch):
        if batch.num_reqs > 1:
            raise RuntimeError("injected: the batched sampler fails")
        apart["rows"] += 1
        return original(self, logits, batch)

    monkeypatch.setattr(Sampler, "__call__", batch_only_fails)
    llm = _llm(tiny_llama_dir)
    got = llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert apart["rows"] > len(PROMPTS)  # the fallback really ran
    assert _tokens(got) == _tokens(expected)
    assert all(o.error is None for o in got)


def test_sampling_tensors_failing_fall_back_to_apart(tiny_llama_dir, monkeypatch):
    """The batch's sampling tensors are gathered before the forward: when that raises, the
    step still runs and each request is sampled apart, with the same tokens."""
    llm = _llm(tiny_llama_dir)
    expected = llm.generate(PROMPTS, _params(), use_tqdm=False)
    original = InputBatch.sampling_batch
    apart = {"rows": 0}

    def batch_only_fails(self, rows, device, extra=None):
        if len(rows) > 1:
            raise RuntimeError("injected: gathering the batch's sampling tensors fails")
        apart["rows"] += 1
        return original(self, rows, device, extra)

    monkeypatch.setattr(InputBatch, "sampling_batch", batch_only_fails)
    llm = _llm(tiny_llama_dir)
    got = llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert apart["rows"] > len(PROMPTS)
    assert _tokens(got) == _tokens(expected)
    assert all(o.error is None for o in got)


def test_non_finite_logits_fail_one_request(tiny_llama_dir, monkeypatch):
    llm = _llm(tiny_llama_dir)
    expected = llm.generate(PROMPTS, _params(), use_tqdm=False)
    llm = _llm(tiny_llama_dir)
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    original_prepare, original_logits = runner.prepare_inputs, runner.model.compute_logits
    step: dict = {}

    def prepare_inputs(sched):
        step["inputs"] = original_prepare(sched)
        return step["inputs"]

    def compute_logits(hidden):  # +inf in every row of the request at temperature 0.8
        logits = original_logits(hidden)
        temperature = runner.input_batch.temperature[step["inputs"].sampled_rows]
        rows = torch.from_numpy(abs(temperature - 0.8) < 1e-6)
        if bool(rows.any()):
            logits = logits.clone()
            logits[rows, 0] = float("inf")
        return logits

    monkeypatch.setattr(runner, "prepare_inputs", prepare_inputs)
    monkeypatch.setattr(runner.model, "compute_logits", compute_logits)
    got = llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert got[1].error is not None and "non-finite logits" in got[1].error
    assert [c.finish_reason for c in got[1].outputs] == ["error"]
    others = [i for i in range(len(PROMPTS)) if i != 1]
    assert _tokens([got[i] for i in others]) == _tokens([expected[i] for i in others])
    core = llm.llm_engine.core
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks
    assert not core.has_unfinished_requests()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_the_check_finds_nan_and_inf_anywhere_in_a_row(value):
    logits = torch.randn(4, 1000)
    logits[2, 997] = value
    logits[3, :] = float("-inf")  # no finite logit at all
    logits[0, 5] = float("-inf")  # one masked token is fine
    assert nonfinite_rows(logits) == [2, 3]
    assert nonfinite_rows(logits[:2].to(torch.bfloat16)) == []
