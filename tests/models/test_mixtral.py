"""Mixtral: the MoE block against a per-token loop, and greedy tokens / logprobs against HF."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedlm import LLM, SamplingParams
from pagedlm.models.mixtral import MixtralForCausalLM, MixtralSparseMoeBlock
from tests.helpers import check_greedy_match, hf_greedy, hf_logprobs_along

PROMPTS = [
    [1, 17, 300, 42, 7],
    [5, 99, 99, 99, 120, 4, 8, 15, 16, 23, 42, 250, 3],
    list(range(3, 40)),
    [77],
]
MAX_TOKENS = 12
CONFIG = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
    initializer_range=0.08, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**CONFIG)).eval()
    with torch.no_grad():  # HF inits norms to 1: make them count
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(path, safe_serialization=True)
    return str(path), model


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, skip_tokenizer_init=True, block_size=4, kv_cache_memory=1 << 22, **kwargs)


def _naive_moe(block: MixtralSparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """One token at a time: softmax, top-k, renormalise, sum of the chosen experts."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(block.gate(x[t]).float(), dim=-1)
        weights, ids = probs.topk(block.top_k)
        weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), ids.tolist()):
            gate, up = (block.w13_weight[e] @ x[t]).chunk(2)
            out[t] += w * (block.w2_weight[e] @ (F.silu(gate) * up))
    return out


def test_moe_block_matches_per_token_loop():
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(hidden_size=32, intermediate_size=48, num_experts=5, top_k=2)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    for num_tokens in (1, 3, 40):
        x = torch.randn(num_tokens, 32)
        torch.testing.assert_close(block(x), _naive_moe(block, x), rtol=1e-5, atol=1e-5)


def test_load_weights_stacks_experts(tiny):
    path, hf = tiny
    from safetensors.torch import load_file

    on_disk = load_file(f"{path}/model.safetensors")  # per-expert w1/w2/w3 names
    assert any(".block_sparse_moe.experts.3.w1." in n for n in on_disk)
    for weights in (on_disk, hf.state_dict()):  # also the stacked in-memory names of transformers v5
        ours = MixtralForCausalLM(hf.config, backend=None, max_position=64, dtype=torch.float32)
        assert ours.load_weights(weights.items()) == {n for n, _ in ours.named_parameters()}
        moe = ours.model.layers[1].block_sparse_moe
        pre = "model.layers.1.block_sparse_moe"
        torch.testing.assert_close(moe.w13_weight[2], torch.cat(
            [on_disk[f"{pre}.experts.2.w1.weight"], on_disk[f"{pre}.experts.2.w3.weight"]]), rtol=0, atol=0)
        torch.testing.assert_close(moe.w2_weight[3], on_disk[f"{pre}.experts.3.w2.weight"], rtol=0, atol=0)
        torch.testing.assert_close(moe.gate.weight, on_disk[f"{pre}.gate.weight"], rtol=0, atol=0)


def test_greedy_equals_hf(tiny):
    path, hf = tiny
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for extra in ({}, {"max_num_batched_tokens": 7}):  # batched, then chunked prefill
        outputs = _llm(path, **extra).generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        for prompt, out, ref in zip(PROMPTS, outputs, refs):
            ours = out.outputs[0].token_ids
            assert len(ours) == MAX_TOKENS
            check_greedy_match(ours, ref, hf_logprobs_along(hf, prompt, ref), len(prompt), context=f"mixtral {extra}")


def test_prompt_logprobs_close_to_hf(tiny):
    path, hf = tiny
    prompt = PROMPTS[2]
    out = _llm(path, max_num_batched_tokens=7).generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=1), use_tqdm=False,
    )[0]
    ref = hf_logprobs_along(hf, prompt, [])  # [len(prompt), vocab]
    for pos in range(1, len(prompt)):
        got = out.prompt_logprobs[pos][prompt[pos]].logprob
        assert got == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4), pos
