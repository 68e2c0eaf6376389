"""GPT-2, GPT BigCode (MQA and MHA) and OPT (pre- and post-LN): greedy tokens and
logprobs equal HF transformers' on the same tiny random weights."""

from __future__ import annotations

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tests.helpers import check_greedy_match, hf_greedy, hf_logprobs_along

PROMPTS = [
    [1, 17, 300, 42, 7],
    [5, 99, 99, 99, 120, 4, 8, 15, 16, 23, 42, 250, 3],
    list(range(3, 22)),  # several blocks of 4
    [77],
]
MAX_TOKENS = 10

_GPT2_COMMON = dict(vocab_size=512, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.08)
_OPT_COMMON = dict(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                   max_position_embeddings=64, init_std=0.08)

# name -> (config class name, model class name, config kwargs)
CASES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", _GPT2_COMMON),
    "bigcode-mqa": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(_GPT2_COMMON, multi_query=True)),
    "bigcode-mha": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM",
                    dict(_GPT2_COMMON, multi_query=False, tie_word_embeddings=False)),
    "opt-proj": ("OPTConfig", "OPTForCausalLM", dict(_OPT_COMMON, word_embed_proj_dim=16)),
    "opt-post-ln": ("OPTConfig", "OPTForCausalLM",
                    dict(_OPT_COMMON, word_embed_proj_dim=32, do_layer_norm_before=False)),
}


@pytest.fixture(scope="module", params=list(CASES))
def tiny(request, tmp_path_factory):
    import transformers

    config_name, model_name, kwargs = CASES[request.param]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**kwargs)
    hf = getattr(transformers, model_name)(config).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    return request.param, str(path), hf


def _check_greedy(llm: LLM, hf, name: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        ours = out.outputs[0].token_ids
        ref = hf_greedy(hf, prompt, MAX_TOKENS)
        assert len(ours) == MAX_TOKENS
        check_greedy_match(ours, ref, hf_logprobs_along(hf, prompt, ref), len(prompt), context=name)


def test_greedy_equals_hf(tiny):
    name, path, hf = tiny
    llm = LLM(path, skip_tokenizer_init=True, block_size=4, kv_cache_memory=1 << 22)
    if name == "bigcode-mqa":
        # One shared kv head: the engine must size (and the model bind) a 1-head KV cache.
        assert all(a.k_cache.shape[2] == 1 for a in llm.llm_engine.model_executor.driver_worker.model.attention_layers())
    _check_greedy(llm, hf, name)
    stats = llm.stats()
    assert stats.num_blocks_free == stats.num_blocks_total


def test_chunked_prefill_and_logprobs(tiny):
    name, path, hf = tiny
    llm = LLM(path, skip_tokenizer_init=True, block_size=4, kv_cache_memory=1 << 22,
              max_num_batched_tokens=7)  # prefills split into chunks across blocks
    _check_greedy(llm, hf, name)
    prompt = PROMPTS[2]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    gen = out.outputs[0].token_ids
    ref = hf_logprobs_along(hf, prompt, gen)
    for pos in range(1, len(prompt)):
        lp = out.prompt_logprobs[pos][prompt[pos]].logprob
        assert lp == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4), (name, pos)
    for i, tok in enumerate(gen):
        lp = out.outputs[0].logprobs[i][tok].logprob
        assert lp == pytest.approx(float(ref[len(prompt) + i - 1, tok]), abs=1e-4), (name, i)


def test_gpt2_rejects_rare_attention_options(tmp_path):
    from transformers import GPT2Config

    from pagedlm.models.gpt2 import GPT2LMHeadModel

    for option in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        config = GPT2Config(**_GPT2_COMMON, **{option: True})
        with pytest.raises(ValueError, match=option):
            GPT2LMHeadModel(config, backend=None, max_position=64, dtype=torch.float32)
