"""BLOOM: greedy outputs and logprobs equal HF transformers' on tiny random checkpoints
(ALiBi attention, fused per-head qkv, both residual placements)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_matches_hf

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
    assert_matches_hf(path, hf, PROMPTS, MAX_TOKENS, context=variant)
