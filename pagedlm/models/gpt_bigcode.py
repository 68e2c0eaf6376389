"""GPT BigCode (SantaCoder, StarCoder) written for paged attention.

The GPT-2 architecture (see `gpt2.py`, whose modules this reuses) with nn.Linear weights
([out, in], no transpose) and optional multi-query attention. The fused `c_attn` rows are

    multi_query=True:   [ q (n_embd) | k (head_dim) | v (head_dim) ]      one shared kv head
    multi_query=False:  [ q0 k0 v0 | q1 k1 v1 | ... ]                      head_dim rows each

and both are split into the q/k/v shards of our QKV projection. With multi_query the KV
cache holds one kv head; HF's GPTBigCodeConfig reports it as `num_key_value_heads`.
"""

from __future__ import annotations

import torch

from pagedlm.models.gpt2 import GPT2LMHeadModel, split_qkv_rows


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    conv1d_weights = False

    @staticmethod
    def check_config(config) -> None:
        if getattr(config, "add_cross_attention", False):
            raise ValueError("GPT BigCode with add_cross_attention=True (an encoder-decoder) is not supported")
        kv_heads = GPTBigCodeForCausalLM.num_kv_heads(config)
        reported = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        # The engine sizes the KV cache from num_key_value_heads; it must match the model.
        assert reported == kv_heads, (reported, kv_heads)

    @staticmethod
    def num_kv_heads(config) -> int:
        return 1 if getattr(config, "multi_query", True) else config.num_attention_heads

    def split_c_attn(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.config.hidden_size
        heads = self.config.num_attention_heads
        if getattr(self.config, "multi_query", True):
            return split_qkv_rows(tensor, hidden, hidden // heads)
        return split_qkv_rows(tensor, hidden, hidden, interleaved_heads=heads)
