"""Original Qwen (QWenLMHeadModel, Qwen-1 / Qwen-7B): a Llama-shaped model with GPT-2 names.

    transformer.wte                      -> model.embed_tokens
    transformer.h.N.ln_1 / ln_2          -> input_layernorm / post_attention_layernorm (RMSNorm)
    transformer.h.N.attn.c_attn          -> q_proj, k_proj, v_proj  ([q; k; v] rows, with bias)
    transformer.h.N.attn.c_proj          -> o_proj                  (no bias)
    transformer.h.N.mlp.w2 / w1          -> gate_proj / up_proj     c_proj(w1(x) * silu(w2(x))):
                                                                    w2 takes the SiLU
    transformer.h.N.mlp.c_proj           -> down_proj
    transformer.ln_f                     -> model.norm
    lm_head                              -> lm_head

So the module tree is Qwen2's (q/k/v biased, o not) and the checkpoint is renamed as it
streams in. Qwen's rotary is rotate-half with head_dim = kv_channels; its dynamic NTK and
logn attention only act beyond `seq_length`, where the context is capped (remote_configs).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedlm.models.llama import Qwen2ForCausalLM

# Qwen name fragment -> Llama name fragment; applied once each, in this order.
_RENAMES = (
    ("transformer.wte.", "model.embed_tokens."),
    ("transformer.ln_f.", "model.norm."),
    ("transformer.h.", "model.layers."),
    (".ln_1.", ".input_layernorm."),
    (".ln_2.", ".post_attention_layernorm."),
    (".attn.c_proj.", ".self_attn.o_proj."),
    (".mlp.w2.", ".mlp.gate_proj."),
    (".mlp.w1.", ".mlp.up_proj."),
    (".mlp.c_proj.", ".mlp.down_proj."),
)


class QWenLMHeadModel(Qwen2ForCausalLM):
    @staticmethod
    def _llama_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            for old, new in _RENAMES:
                name = name.replace(old, new)
            if ".attn.c_attn." in name:
                # no GQA: q, k and v are equal thirds of the rows (and of the bias)
                for part, chunk in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0)):
                    yield name.replace("attn.c_attn", f"self_attn.{part}"), chunk
            else:
                yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._llama_names(weights))
