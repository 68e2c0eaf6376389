"""InternLM (v1) and Aquila: remote-code checkpoints that are Llama under another name.

Both keep HF Llama's parameter names (model.layers.N.self_attn.q_proj, ...). InternLM v1
adds biases on q/k/v/o (`bias: true` in its config.json, mapped to `attention_bias` by
`pagedlm.models.remote_configs`); Aquila is plain Llama. Their dynamic-NTK rotary variants
only differ beyond max_position_embeddings, where the engine caps the context.
"""

from __future__ import annotations

from pagedlm.models.llama import LlamaForCausalLM


class InternLMForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        # InternLM's own code defaults `bias` to true when config.json omits it.
        bias = bool(getattr(config, "attention_bias", getattr(config, "bias", True)))
        return bias, bias


class AquilaForCausalLM(LlamaForCausalLM):
    pass
