"""Qwen3 and Phi-3: greedy tokens and logprobs equal HF transformers' on tiny random models."""

from __future__ import annotations

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tests.helpers import check_greedy_match, hf_greedy, hf_logprobs_along

PROMPTS = [
    [1, 17, 300, 42, 7],
    [5, 99, 99, 99, 120, 4, 8, 15, 16, 23, 42, 250, 3],
    list(range(3, 40)),
    [77],
]
MAX_TOKENS = 12
BASE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    initializer_range=0.08, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def _longrope(n: int, original: int) -> dict:
    # Phi3Config copies its top-level original_max_position_embeddings into rope_parameters
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(n)], "long_factor": [2.0 + 0.5 * i for i in range(n)]}
    return dict(rope_parameters=rope, original_max_position_embeddings=original)


VARIANTS = {
    # head_dim 32 != hidden / heads (16); q/k/v/o biases on
    "qwen3-bias": ("Qwen3", dict(head_dim=32, attention_bias=True)),
    "qwen3-tied": ("Qwen3", dict(head_dim=16, tie_word_embeddings=True)),
    "phi3": ("Phi3", {}),
    "phi3-partial-tied": ("Phi3", dict(partial_rotary_factor=0.5, tie_word_embeddings=True)),
    # max_position_embeddings == original: the short factors, as HF uses for every length here
    "phi3-longrope-short": ("Phi3", dict(max_position_embeddings=64, **_longrope(8, 64))),
    # max_position_embeddings > original: the long factors, as HF uses once a sequence exceeds 16
    "phi3-longrope-long": ("Phi3", _longrope(8, 16)),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import transformers

    cache: dict[str, tuple[str, torch.nn.Module]] = {}

    def get(name: str) -> tuple[str, torch.nn.Module]:
        if name not in cache:
            family, overrides = VARIANTS[name]
            torch.manual_seed(len(cache))
            config = getattr(transformers, f"{family}Config")(**{**BASE, **overrides})
            model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
            with torch.no_grad():  # HF inits norms to 1 and biases to 0: make them count
                for pname, param in model.named_parameters():
                    if "norm" in pname:
                        param.uniform_(0.5, 1.5)
                    elif pname.endswith("bias"):
                        param.normal_(0.0, 0.05)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path, safe_serialization=True)
            cache[name] = (str(path), model)
        return cache[name]

    return get


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, skip_tokenizer_init=True, block_size=4, kv_cache_memory=1 << 22, **kwargs)


@pytest.mark.parametrize("name", ["qwen3-bias", "qwen3-tied", "phi3", "phi3-partial-tied", "phi3-longrope-short"])
def test_greedy_equals_hf(tiny, name):
    path, hf = tiny(name)
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for extra in ({}, {"max_num_batched_tokens": 7}):  # batched, then chunked prefill
        llm = _llm(path, **extra)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        for prompt, out, ref in zip(PROMPTS, outputs, refs):
            ours = out.outputs[0].token_ids
            assert len(ours) == MAX_TOKENS
            check_greedy_match(ours, ref, hf_logprobs_along(hf, prompt, ref), len(prompt),
                               context=f"{name} {extra}")


@pytest.mark.parametrize("name", ["qwen3-bias", "phi3-partial-tied", "phi3-longrope-long"])
def test_prompt_logprobs_close_to_hf(tiny, name):
    path, hf = tiny(name)
    prompt = PROMPTS[2]  # 37 tokens: past longrope's original 16, so HF uses the long factors
    out = _llm(path, max_num_batched_tokens=7).generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=1), use_tqdm=False,
    )[0]
    ref = hf_logprobs_along(hf, prompt, [])  # [len(prompt), vocab]
    for pos in range(1, len(prompt)):
        got = out.prompt_logprobs[pos][prompt[pos]].logprob
        assert got == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4), (name, pos)


def test_phi3_fused_weights_split_per_rank_shards(tiny):
    from pagedlm.models.phi3 import Phi3ForCausalLM

    path, hf = tiny("phi3")
    ours = Phi3ForCausalLM(hf.config, backend=None, max_position=64, dtype=torch.float32)
    loaded = ours.load_weights(hf.state_dict().items())
    assert loaded == {n for n, _ in ours.named_parameters()}
    layer, ref = ours.model.layers[0], hf.model.layers[0]
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, ref.self_attn.qkv_proj.weight, rtol=0, atol=0)
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight, ref.mlp.gate_up_proj.weight, rtol=0, atol=0)
