"""MPT: greedy outputs and logprobs equal HF transformers' on tiny random checkpoints
(ALiBi with MPT's slope rule, fused [q; k; v] rows, clip_qkv, softmax_scale override)."""

from __future__ import annotations

import pytest
import torch

from pagedlm.models.mpt import check_mpt_config, mpt_alibi_slopes
from tests.helpers import assert_matches_hf

PROMPTS = [
    [1, 17, 300, 42, 7],
    [5, 99, 99, 99, 120, 4, 8, 15, 16, 23, 42, 250, 3],
    list(range(3, 23)),
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory) -> dict[str, str]:
    from transformers import MptConfig, MptForCausalLM

    variants = {
        "h4": dict(n_heads=4, d_model=64),
        # 6 heads: MPT's non-power-of-two slopes (unlike BLOOM's); clamp of the fused qkv; scale override.
        "h6-clip": dict(n_heads=6, d_model=96, attn_config=dict(clip_qkv=0.3, softmax_scale=0.2)),
    }
    paths = {}
    for seed, (name, extra) in enumerate(variants.items()):
        config = MptConfig(**{**dict(vocab_size=512, n_layers=2, max_seq_len=64, initializer_range=0.08), **extra})
        torch.manual_seed(seed)
        model = MptForCausalLM(config).eval()
        with torch.no_grad():  # norms are initialised to ones; make them matter
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.uniform_(0.5, 1.5)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path, safe_serialization=True)
        paths[name] = str(path)
    return paths


@pytest.mark.parametrize("num_heads", [1, 4, 6, 12, 16, 20])
def test_slopes_equal_hf(num_heads):
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    ref = build_mpt_alibi_tensor(num_heads, 2)[:, 0, 0] * -1  # position -1 column: -slope
    assert torch.equal(mpt_alibi_slopes(num_heads), ref)


def test_rejects_unsupported_configs():
    from transformers import MptConfig

    for bad in (dict(attn_config=dict(alibi=False)), dict(attn_config=dict(qk_ln=True)),
                dict(attn_config=dict(prefix_lm=True)), dict(no_bias=False)):
        with pytest.raises(ValueError, match="unsupported MPT config"):
            check_mpt_config(MptConfig(**bad))


@pytest.mark.parametrize("variant", ["h4", "h6-clip"])
def test_greedy_and_logprobs_equal_hf(tiny_paths, variant):
    from transformers import AutoModelForCausalLM

    path = tiny_paths[variant]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert_matches_hf(path, hf, PROMPTS, MAX_TOKENS, context=variant)
