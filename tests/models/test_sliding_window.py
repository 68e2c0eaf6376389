"""Sliding-window attention end to end: tiny random HF Mistral / Qwen2 checkpoints whose
window is shorter than the prompts, generating past several windows. Greedy tokens must
equal HF's (batched, and with chunked prefill), and with one window on every layer the
KV blocks a request holds must stay bounded: the blocks behind the window are freed."""

from __future__ import annotations

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.core.kv_cache_manager import cdiv
from pagedlm.models.llama import layer_sliding_windows
from tests.helpers import check_greedy_match, hf_greedy, hf_logprobs_along

BS = 4
PROMPTS = [
    list(range(3, 40)),  # 37 tokens
    [5, 99, 99, 99, 120, 4, 8, 15, 16, 23, 42, 250, 3, 77, 301, 18, 19, 400, 21, 22, 6, 9, 11, 13, 200],
    [(7 * i) % 500 + 3 for i in range(50)],
    [77, 78, 79],
]
MAX_TOKENS = 48
BASE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.08, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
MODELS = {
    # name: (config class, model class, overrides, window on every layer or None)
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16), 16),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(use_sliding_window=True, sliding_window=20, max_window_layers=0), 20),
    # Layer 0 global, layer 1 windowed: masking only, nothing freed.
    "qwen2-mixed": ("Qwen2Config", "Qwen2ForCausalLM",
                    dict(use_sliding_window=True, sliding_window=12, max_window_layers=1), None),
}


@pytest.fixture(scope="module", params=list(MODELS))
def tiny(request, tmp_path_factory):
    import transformers

    config_cls, model_cls, overrides, window = MODELS[request.param]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**BASE, **overrides)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # HF inits norms to 1: make them count
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    refs = [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    return request.param, str(path), model, refs, window


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams, window: int | None) -> list[list[int]]:
    """Step the engine by hand, checking the blocks every running request holds."""
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    assert kv.sliding_window == window
    first_id = engine.get_stats().num_steps * 1000  # fresh ids on each call
    for i, p in enumerate(prompts):
        engine.add_request(str(first_id + i), None, params, prompt_token_ids=p)
    budget = engine.scheduler.config.max_num_batched_tokens
    outputs, max_held = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        engine.scheduler.check_invariants()
        for r in engine.scheduler.running:
            held = kv.num_held_blocks(r.request_id)
            max_held = max(max_held, held)
            if window is not None:
                # Decodes hold at most cdiv(W, bs) + 1 blocks; a prefill chunk of k more.
                assert held <= kv.max_blocks_held(r.num_tokens, budget), (r, held)
    longest = max(len(p) for p in prompts) + params.max_tokens
    if window is not None:
        assert max_held < cdiv(longest, BS)  # blocks were really freed
    else:
        assert max_held >= cdiv(longest, BS) - 1  # nothing freed: every token kept
    assert kv.num_free_blocks == kv.num_blocks  # nothing leaked
    return [o.outputs[0].token_ids for _, o in sorted(outputs.items(), key=lambda kv: int(kv[0]))]


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunked7"])
def test_greedy_matches_hf_past_several_windows(tiny, chunk) -> None:
    name, path, hf, refs, window = tiny
    extra = {} if chunk is None else {"max_num_batched_tokens": chunk}
    llm = LLM(path, skip_tokenizer_init=True, block_size=BS, kv_cache_memory=1 << 22, **extra)
    assert llm.llm_engine.max_model_len == BASE["max_position_embeddings"]  # no cap at the window
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # Round 2 hits the prefix cache: the early blocks the window freed are still cached
    # (the cache is large); hits the new requests cannot see get no reference.
    for round in range(2):
        for prompt, ref, ours in zip(PROMPTS, refs, _run(llm, PROMPTS, params, window)):
            assert len(ours) == MAX_TOKENS
            check_greedy_match(ours, ref, hf_logprobs_along(hf, prompt, ref), len(prompt),
                               context=f"{name} chunk={chunk} round={round}")
    assert llm.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("tiny", [m for m, spec in MODELS.items() if spec[3] is not None],
                         indirect=True)  # masking-only models free nothing: no small cache
def test_forks_prefix_hits_and_small_cache(tiny) -> None:
    """n=2 samples share the prompt's blocks (and copy the partial one), twice, in a cache
    far smaller than prompt + generation of every request together. (The freed early
    blocks are reused long before the second round: the chained prefix lookup stops at
    the first evicted block, so this round has no hits, which is correct.)"""
    name, path, hf, refs, window = tiny
    # 40 usable blocks (160 tokens); each request alone runs to 98 tokens.
    block_bytes = 2 * BASE["num_hidden_layers"] * BS * BASE["num_key_value_heads"] * 16 * 4
    llm = LLM(path, skip_tokenizer_init=True, block_size=BS, kv_cache_memory=41 * block_bytes,
              max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        for prompt, ref, out in zip(PROMPTS, refs, outs):
            for sample in out.outputs:
                check_greedy_match(sample.token_ids, ref, hf_logprobs_along(hf, prompt, ref), len(prompt),
                                   context=f"{name} n=2")
    kv = llm.llm_engine.kv_cache_manager
    kv.check_invariants([])
    assert kv.num_free_blocks == kv.num_blocks == 40


def test_layer_windows_follow_hf_config_rules() -> None:
    import transformers

    def windows(config_cls, **kw):
        config = getattr(transformers, config_cls)(**BASE, **kw)
        return layer_sliding_windows(config)

    assert windows("LlamaConfig") == [None, None]
    assert windows("MistralConfig", sliding_window=None) == [None, None]
    assert windows("MistralConfig", sliding_window=8) == [8, 8]
    assert windows("MixtralConfig", sliding_window=8) == [8, 8]
    assert windows("Qwen2Config", use_sliding_window=False, sliding_window=8) == [None, None]
    assert windows("Qwen2Config", use_sliding_window=True, sliding_window=8, max_window_layers=1) == [None, 8]
    assert windows("Qwen3Config", use_sliding_window=True, sliding_window=8, max_window_layers=0) == [8, 8]
    assert windows("Qwen2Config", use_sliding_window=True, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"]) == [8, None]
