"""HF `architectures` name -> model class. The class is picked once, when loading."""

from __future__ import annotations

import importlib

# name -> (module under pagedlm.models, class)
_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3ForConditionalGeneration"),
    "GPTNeoXForCausalLM": ("gpt_neox", "GPTNeoXForCausalLM"),
    "BloomForCausalLM": ("bloom", "BloomForCausalLM"),
    "MptForCausalLM": ("mpt", "MptForCausalLM"),
    "GPTJForCausalLM": ("gptj", "GPTJForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "GPTBigCodeForCausalLM": ("gpt_bigcode", "GPTBigCodeForCausalLM"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "FalconForCausalLM": ("falcon", "FalconForCausalLM"),
    "QWenLMHeadModel": ("qwen", "QWenLMHeadModel"),
    "BaichuanForCausalLM": ("baichuan", "BaichuanForCausalLM"),
    "BaiChuanForCausalLM": ("baichuan", "BaichuanForCausalLM"),
    "InternLMForCausalLM": ("internlm", "InternLMForCausalLM"),
    "AquilaForCausalLM": ("internlm", "AquilaForCausalLM"),
    "AquilaModel": ("internlm", "AquilaForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architectures: list[str] | None):
    for arch in architectures or ():
        if arch in _MODELS:
            module, cls = _MODELS[arch]
            return getattr(importlib.import_module(f"pagedlm.models.{module}"), cls)
    raise ValueError(
        f"model architecture {architectures} is not supported; supported architectures: "
        f"{', '.join(supported_architectures())}"
    )
