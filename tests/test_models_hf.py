"""Greedy outputs and logprobs equal HF transformers' on the same weights."""

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tests.helpers import check_greedy_match, hf_greedy, hf_logprobs_along

PROMPTS = [
    [1, 17, 300, 42, 7],
    [5, 99, 99, 99, 120, 4, 8, 15, 16, 23, 42, 250, 3],
    list(range(3, 40)),  # longer than a couple of blocks
    [77],
]
MAX_TOKENS = 24


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_greedy_equals_hf(tiny_models, arch):
    path = tiny_models[arch]
    hf = _hf_model(path)
    llm = LLM(path, skip_tokenizer_init=True, block_size=8, kv_cache_memory=1 << 24)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        ours = out.outputs[0].token_ids
        ref = hf_greedy(hf, prompt, MAX_TOKENS)
        assert len(ours) == MAX_TOKENS
        check_greedy_match(ours, ref, hf_logprobs_along(hf, prompt, ref), len(prompt), context=arch)
    stats = llm.stats()
    assert stats.num_blocks_free == stats.num_blocks_total


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logprobs_close_to_hf(tiny_models, arch):
    path = tiny_models[arch]
    hf = _hf_model(path)
    llm = LLM(path, skip_tokenizer_init=True, block_size=4, kv_cache_memory=1 << 24,
              max_num_batched_tokens=7)  # chunked prefill across blocks
    prompt = PROMPTS[2]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    gen = out.outputs[0].token_ids
    ref = hf_logprobs_along(hf, prompt, gen)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert prompt[pos] in entry
        assert entry[prompt[pos]].logprob == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4)
        top = torch.topk(ref[pos - 1], 2).indices.tolist()
        assert {t for t, lp in entry.items() if lp.rank <= 2} == set(top)
    for i, tok in enumerate(gen):
        entry = out.outputs[0].logprobs[i]
        assert entry[tok].logprob == pytest.approx(float(ref[len(prompt) + i - 1, tok]), abs=1e-4)
        assert entry[tok].rank == 1  # greedy picks the top token
    cum = sum(out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(gen))
    assert out.outputs[0].cumulative_logprob == pytest.approx(cum, abs=1e-4)


def test_dummy_weights_run(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, load_format="dummy", skip_tokenizer_init=True, kv_cache_memory=1 << 22)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5
