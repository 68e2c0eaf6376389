"""Gemma 2 and Gemma 3 (text): greedy tokens and logprobs equal HF transformers' on tiny
random models with every feature on: GQA, head_dim != hidden / heads, query_pre_attn_scalar
!= head_dim, sliding-window layers with a window shorter than the prompts next to global
layers, attention and final logit soft-caps (Gemma 2), q/k norms and two RoPEs, one of them
linearly scaled (Gemma 3)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_matches_hf

PROMPTS = [
    [2, 17, 300, 42, 7],
    [2, 99, 99, 99, 120, 4, 8, 15, 16, 23, 42, 250, 3],
    [2, *range(3, 40)],
    [77],
]
MAX_TOKENS = 12
BASE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
    query_pre_attn_scalar=24, sliding_window=6, initializer_range=0.08,
    pad_token_id=0, eos_token_id=1, bos_token_id=2, attn_implementation="eager",
)
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}
VARIANTS = {
    # caps small enough to bite on random weights; layers 0, 2 sliding, 1, 3 global
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma2-untied": ("Gemma2Config", "Gemma2ForCausalLM",
                      dict(attn_logit_softcapping=2.0, final_logit_softcapping=None,
                           tie_word_embeddings=False, num_key_value_heads=1)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters=GEMMA3_ROPE)),
    "gemma3-softcap": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                       dict(sliding_window_pattern=2, final_logit_softcapping=3.0)),
}


def _randomize_norms(model: torch.nn.Module) -> None:
    # HF initialises Gemma norm weights to 0 (a scale of 1 + 0): make them count.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import transformers

    cache: dict[str, tuple[str, torch.nn.Module]] = {}

    def get(name: str) -> tuple[str, torch.nn.Module]:
        if name not in cache:
            config_cls, model_cls, overrides = VARIANTS[name]
            torch.manual_seed(len(cache))
            config = getattr(transformers, config_cls)(**{**BASE, **overrides})
            model = getattr(transformers, model_cls)(config).eval()
            _randomize_norms(model)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path, safe_serialization=True)
            cache[name] = (str(path), model)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_hf(tiny, name):
    path, hf = tiny(name)
    assert hf.config._attn_implementation == "eager"
    assert_matches_hf(path, hf, PROMPTS, MAX_TOKENS, context=name)


def test_layer_kinds_and_rope_bases(tiny):
    from pagedlm.models.gemma3 import Gemma3ForCausalLM

    _, hf = tiny("gemma3")
    ours = Gemma3ForCausalLM(hf.config, backend=None, max_position=64, dtype=torch.float32)
    attn = [layer.self_attn for layer in ours.model.layers]
    assert [a.attn.sliding_window for a in attn] == [6, 6, None, 6]
    assert all(a.attn.logits_soft_cap is None for a in attn)
    assert attn[0].rotary_emb is attn[1].rotary_emb is not attn[2].rotary_emb
    # position 1: cos of the slowest frequency, base^(-(d-2)/d), divided by 4 on global layers
    d = 32
    for a, base, factor in ((attn[0], 10_000.0, 1.0), (attn[2], 1_000_000.0, 4.0)):
        expected = torch.cos(torch.tensor(base ** (-(d - 2) / d) / factor))
        torch.testing.assert_close(a.rotary_emb.cos_cache[1, d // 2 - 1], expected)


@pytest.mark.parametrize("language_model, vision", [
    ("model.language_model.", "model."),  # transformers >= 4.52 in memory
    ("language_model.model.", ""),  # what save_pretrained writes (and older checkpoints)
])
def test_conditional_generation_loads_language_model(tiny, language_model, vision):
    """A multimodal Gemma 3 checkpoint: the language model's tensors renamed, vision tensors
    skipped, the text config used."""
    import transformers

    from pagedlm.models.gemma3 import Gemma3ForConditionalGeneration

    _, hf = tiny("gemma3")
    config = transformers.Gemma3Config(text_config=hf.config.to_dict())
    ours = Gemma3ForConditionalGeneration(config, backend=None, max_position=64, dtype=torch.float32)
    weights = [(name.replace("model.", language_model, 1), t) for name, t in hf.state_dict().items()
               if name != "lm_head.weight"]  # tied: not saved
    weights.append((f"{vision}vision_tower.vision_model.post_layernorm.weight", torch.zeros(8)))
    weights.append((f"{vision}multi_modal_projector.mm_input_projection_weight", torch.zeros(8, 8)))
    loaded = ours.load_weights(weights)
    assert loaded == {n for n, _ in ours.named_parameters()}
    torch.testing.assert_close(ours.model.layers[2].self_attn.k_norm.weight,
                               hf.model.layers[2].self_attn.k_norm.weight, rtol=0, atol=0)


def test_rejects_unknown_activation(tiny):
    from pagedlm.models.gemma2 import GemmaMLP

    with pytest.raises(ValueError, match="hidden_activation"):
        GemmaMLP(8, 16, "relu")


def test_conditional_generation_checkpoint_end_to_end(tiny, tmp_path):
    """A saved multimodal Gemma 3 directory (Gemma3Config with a text config, language-model
    tensors under their multimodal names) serves its language model through `LLM`."""
    import json

    import transformers
    from safetensors.torch import save_file

    _, hf = tiny("gemma3")
    config = transformers.Gemma3Config(text_config=hf.config.to_dict())
    config.architectures = ["Gemma3ForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    assert "text_config" in json.loads((tmp_path / "config.json").read_text())
    tensors = {name.replace("model.", "language_model.model.", 1): t.contiguous()
               for name, t in hf.state_dict().items() if name != "lm_head.weight"}
    tensors["vision_tower.vision_model.post_layernorm.weight"] = torch.zeros(8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert_matches_hf(str(tmp_path), hf, PROMPTS[:2], MAX_TOKENS, "gemma3-multimodal")
