import functools
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_SMOLLM2_MISSING: list[str] = []


@functools.cache
def smollm2_path() -> str | None:
    """The embedded default model, fetched on first use as a user's first run does (the
    tests that need it then run, not skip); None, with the reason kept, if that fails."""
    from pagedlm.loader.default_model import DefaultModelUnavailable, default_model_path

    try:
        return default_model_path()
    except DefaultModelUnavailable as e:
        _SMOLLM2_MISSING.append(str(e))
        return None


def pytest_ignore_collect(collection_path, config):
    """tests/stress (the reliability suite, minutes long) runs only when named."""
    if collection_path.name == "stress" and collection_path.parent.name == "tests":
        return not any("stress" in str(arg) for arg in config.args)
    return None


requires_smollm2 = pytest.mark.skipif(
    smollm2_path() is None,
    reason=f"the default model is not available: {''.join(_SMOLLM2_MISSING)}")


def _save_tiny(tmp_dir, config_cls, model_cls, seed=0, **overrides):
    import torch

    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.08, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    model = model_cls(config).eval()
    model.save_pretrained(tmp_dir, safe_serialization=True)
    return str(tmp_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), LlamaConfig, LlamaForCausalLM)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tiny_llama_dir):
    """Tiny random checkpoints of each Llama-family architecture, with its features on."""
    from transformers import (
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    return {
        "llama": tiny_llama_dir,
        "mistral": _save_tiny(tmp_path_factory.mktemp("tiny-mistral"), MistralConfig,
                              MistralForCausalLM, seed=1, sliding_window=None),
        "qwen2": _save_tiny(tmp_path_factory.mktemp("tiny-qwen2"), Qwen2Config, Qwen2ForCausalLM,
                            seed=2, num_key_value_heads=1, tie_word_embeddings=True),
    }
