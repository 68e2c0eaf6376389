"""Falcon: greedy outputs and logprobs equal HF transformers' on tiny random checkpoints of
each decoder layout (new-architecture GQA, old multi-query parallel, old multi-head serial),
and of Falcon-RW (ALiBi instead of rotary, on the old multi-head serial layout)."""

from __future__ import annotations

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tests.helpers import assert_matches_hf, check_greedy_match, hf_greedy, hf_logprobs_along

PROMPTS = [
    [1, 17, 300, 42, 7],
    [5, 99, 99, 99, 120, 4, 8, 15, 16, 23, 42, 250, 3],
    list(range(3, 23)),
]
MAX_TOKENS = 12
BASE = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
            max_position_embeddings=256, initializer_range=0.08)
LAYOUTS = {
    "new-gqa": dict(new_decoder_architecture=True, num_kv_heads=2, bias=True),
    "old-mqa-parallel": dict(multi_query=True, parallel_attn=True),
    "old-mha-serial": dict(multi_query=False, parallel_attn=False, bias=True, ffn_hidden_size=96),
}
# 8 heads: slopes 2^-1 .. 2^-8, for which HF's bf16 rounding of slope * position is exact
# (see pagedlm/models/falcon.py).
ALIBI_LAYOUTS = {
    "rw-alibi": dict(alibi=True, multi_query=False, parallel_attn=False, bias=True),  # falcon-rw-1b's
    "alibi-mqa-parallel": dict(alibi=True, multi_query=True, parallel_attn=True),  # 8 heads on 1 KV head
}


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory) -> dict[str, str]:
    from transformers import FalconConfig, FalconForCausalLM

    paths = {}
    for seed, (name, extra) in enumerate({**LAYOUTS, **ALIBI_LAYOUTS}.items()):
        torch.manual_seed(seed)
        path = tmp_path_factory.mktemp(name)
        FalconForCausalLM(FalconConfig(**BASE, **extra)).eval().save_pretrained(path, safe_serialization=True)
        paths[name] = str(path)
    return paths


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    # SDPA, as by default: HF's eager Falcon attention adds the ALiBi bias twice.
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_equals_hf(tiny_paths, layout):
    path = tiny_paths[layout]
    hf = _hf(path)
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
                               context=f"{layout} chunk={chunk}")
    # The KV cache holds exactly the KV heads the checkpoint has (GQA 2, multi-query 1).
    expected_kv = {"new-gqa": 2, "old-mqa-parallel": 1, "old-mha-serial": 8}[layout]
    for attn in llm.llm_engine.model_executor.driver_worker.model.attention_layers():
        assert attn.k_cache.shape[2] == expected_kv

    if layout == "new-gqa":
        prompt = PROMPTS[1]
        lp_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)
        out = llm.generate({"prompt_token_ids": prompt}, lp_params, use_tqdm=False)[0]
        ref = hf_logprobs_along(hf, prompt, [])
        for pos in range(1, len(prompt)):
            got = out.prompt_logprobs[pos][prompt[pos]].logprob
            assert got == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4)


@pytest.mark.parametrize("layout", list(ALIBI_LAYOUTS))
def test_alibi_greedy_and_logprobs_equal_hf(tiny_paths, layout):
    path = tiny_paths[layout]
    assert_matches_hf(path, _hf(path), PROMPTS, MAX_TOKENS, context=layout)


def test_alibi_slopes_follow_hf():
    """HF Falcon's bias is bf16(bf16(slope) * j), added before the 1/sqrt(head_dim) scale;
    ours is slope * (j - i) with the scale folded in: the slopes (HF's bias at j = 1) are
    equal for every head count, power of two or not."""
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    from pagedlm.models.falcon import falcon_alibi_slopes

    for heads in (8, 32, 6):
        hf = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), heads, torch.float32)[:, 0, 1]
        assert torch.equal(falcon_alibi_slopes(heads, head_dim=16), hf / 4)  # position 1: the slopes
