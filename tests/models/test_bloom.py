"""BLOOM: greedy outputs and logprobs equal HF transformers' on tiny random checkpoints
(ALiBi attention, fused per-head qkv, both residual placements)."""

from __future__ import annotations

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tests.helpers import check_greedy_match, hf_greedy, hf_logprobs_along

PROMPTS = [
    [1, 17, 300, 42, 7],
    [5, 99, 99, 99, 120, 4, 8, 15, 16, 23, 42, 250, 3],
    list(range(3, 23)),
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory) -> dict[str, str]:
    from transformers import BloomConfig, BloomForCausalLM

    variants = {
        "h4": dict(n_head=4, apply_residual_connection_post_layernorm=False),
        # 6 heads: the non-power-of-two ALiBi slopes; residual after the layer norm.
        "h6-post-ln": dict(n_head=6, hidden_size=96, apply_residual_connection_post_layernorm=True),
    }
    paths = {}
    for seed, (name, extra) in enumerate(variants.items()):
        config = BloomConfig(**{**dict(vocab_size=512, hidden_size=64, n_layer=2, initializer_range=0.08), **extra})
        torch.manual_seed(seed)
        path = tmp_path_factory.mktemp(name)
        BloomForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
        paths[name] = str(path)
    return paths


@pytest.mark.parametrize("variant", ["h4", "h6-post-ln"])
def test_greedy_and_logprobs_equal_hf(tiny_paths, variant):
    from transformers import AutoModelForCausalLM

    path = tiny_paths[variant]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for chunk in (None, 7):  # batched; chunked prefill across blocks
        extra = {} if chunk is None else {"max_num_batched_tokens": chunk}
        llm = LLM(path, skip_tokenizer_init=True, block_size=4, kv_cache_memory=1 << 22, **extra)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        for prompt, ref, out in zip(PROMPTS, refs, outputs):
            ours = out.outputs[0].token_ids
            assert len(ours) == MAX_TOKENS
            check_greedy_match(ours, ref, hf_logprobs_along(hf, prompt, ref), len(prompt),
                               context=f"{variant} chunk={chunk}")

    prompt = PROMPTS[1]
    lp_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate({"prompt_token_ids": prompt}, lp_params, use_tqdm=False)[0]
    ref = hf_logprobs_along(hf, prompt, [])
    for pos in range(1, len(prompt)):
        got = out.prompt_logprobs[pos][prompt[pos]].logprob
        assert got == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4)
