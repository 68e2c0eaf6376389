"""Mixtral: Llama attention with a sparse mixture-of-experts block in place of the MLP.

Routing, per token (as HF): softmax of the router logits in float32, the top
`num_experts_per_tok` probabilities, renormalised to sum to 1. Each expert is a SwiGLU MLP
(w1 = gate, w3 = up, w2 = down). Expert weights are stacked so that a fused MoE kernel or
expert parallelism can take them whole:

    w13_weight  [num_experts, 2 * I/tp, hidden]   rows: [ w1 (gate) | w3 (up) ] of each expert
    w2_weight   [num_experts, hidden, I/tp]

With tensor parallelism every rank holds a slice of every expert's intermediate dim and the
partial outputs are summed, exactly as a row-parallel linear does.
Sliding window: `sliding_window` (None: off) on every layer, as in HF.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.layers.linear import ReplicatedLinear
from pagedlm.layers.norm import RMSNorm
from pagedlm.layers.parallel_state import all_reduce, get_tp_group
from pagedlm.layers.rotary import RotaryEmbedding
from pagedlm.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    layer_sliding_windows,
)

# HF per-expert checkpoint names (the format on disk): ...block_sparse_moe.experts.N.w1.weight
_EXPERT_NAME = re.compile(r"^(.*)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
# transformers v5 in-memory names: ...mlp.experts.gate_up_proj / down_proj (already stacked)
_STACKED_NAME = re.compile(r"^(.*)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_tokens, num_experts] logits -> (weights fp32, expert ids), each [num_tokens, top_k]."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = probs.topk(top_k, dim=-1)
    topk_weights /= topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        tp = get_tp_group()
        if intermediate_size % tp.size:
            raise ValueError(
                f"intermediate_size ({intermediate_size}) is not divisible by the tensor-parallel size ({tp.size})"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.intermediate_size = intermediate_size // tp.size  # this rank's
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * self.intermediate_size, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.intermediate_size), requires_grad=False
        )
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """shard_id: (expert_id, "w1" | "w2" | "w3") for one HF expert matrix, or
        "gate_up_proj" / "down_proj" for an already stacked [num_experts, ...] tensor."""
        rank, size = get_tp_group().rank, get_tp_group().size
        inter = self.intermediate_size
        if shard_id == "gate_up_proj":  # [E, 2I, H] = [gate | up] along dim 1
            gate, up = loaded.chunk(2, dim=1)
            loaded = torch.cat([gate.narrow(1, rank * inter, inter), up.narrow(1, rank * inter, inter)], dim=1)
            dst = param.data
        elif shard_id == "down_proj":  # [E, H, I]
            loaded, dst = loaded.narrow(2, rank * inter, inter), param.data
        else:
            expert_id, which = shard_id
            if not 0 <= expert_id < self.num_experts:
                raise ValueError(f"expert {expert_id} outside num_local_experts ({self.num_experts})")
            if which == "w2":  # [H, I]: split the input features
                if loaded.shape[1] != inter * size:
                    raise ValueError(f"w2 has {loaded.shape[1]} input features, expected {inter * size}")
                loaded, dst = loaded.narrow(1, rank * inter, inter), param.data[expert_id]
            else:  # [I, H]: split the output features
                if loaded.shape[0] != inter * size:
                    raise ValueError(f"{which} has {loaded.shape[0]} output features, expected {inter * size}")
                offset = 0 if which == "w1" else inter
                loaded = loaded.narrow(0, rank * inter, inter)
                dst = param.data[expert_id, offset:offset + inter]
        if dst.shape != loaded.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(dst.shape)}, checkpoint {tuple(loaded.shape)}")
        dst.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        topk_weights, topk_ids = route(self.gate(x), self.top_k)  # [num_tokens, top_k]
        # Group the (token, slot) assignments by expert: one sort, then a loop over experts.
        flat_ids = topk_ids.flatten()  # [num_tokens * top_k]
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_idx = order // self.top_k  # [num_tokens * top_k], grouped by expert
        weights = topk_weights.flatten()[order]
        out = torch.zeros_like(x)  # [num_tokens, hidden]
        start = 0
        for expert_id, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_idx[start:start + count]
            w = weights[start:start + count]
            start += count
            gate, up = F.linear(x[tokens], self.w13_weight[expert_id]).chunk(2, dim=-1)  # [count, I]
            y = F.linear(F.silu(gate) * up, self.w2_weight[expert_id])  # [count, hidden]
            out.index_add_(0, tokens, (y * w[:, None]).to(out.dtype))
        assert start == num_tokens * self.top_k
        return all_reduce(out)


class MixtralDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, rotary: RotaryEmbedding, backend, qkv_bias: bool, o_bias: bool,
                 sliding_window: int | None = None) -> None:
        nn.Module.__init__(self)
        self.self_attn = LlamaAttention(config, rotary, backend, qkv_bias, o_bias, sliding_window)
        self.block_sparse_moe = MixtralSparseMoeBlock(
            config.hidden_size, config.intermediate_size, config.num_local_experts, config.num_experts_per_tok
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.block_sparse_moe(x), residual


class MixtralModel(LlamaModel):
    def __init__(self, config, rotary: RotaryEmbedding, backend, qkv_bias: bool, o_bias: bool) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            MixtralDecoderLayer(config, rotary, backend, qkv_bias, o_bias, window)
            for window in layer_sliding_windows(config)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MixtralForCausalLM(LlamaForCausalLM):
    """HF parameter names, except experts: `experts.N.{w1,w3}` -> `w13_weight[N]`, `w2` -> `w2_weight[N]`."""

    def __init__(self, config, backend, max_position: int, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.config = config
        qkv_bias, o_bias = self.attention_biases(config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = RotaryEmbedding(config, head_dim, max_position, dtype)
        self.model = MixtralModel(config, rotary, backend, qkv_bias, o_bias)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def load(target: str, name: str, tensor: torch.Tensor, shard_id) -> None:
            param = params[target]
            try:
                param.weight_loader(param, tensor.to(param.dtype), shard_id)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            loaded.add(target)

        def others():
            for name, tensor in weights:
                if m := _EXPERT_NAME.match(name):
                    prefix, expert_id, which = m.group(1), int(m.group(2)), m.group(3)
                    param = "w2_weight" if which == "w2" else "w13_weight"
                    load(f"{prefix}.block_sparse_moe.{param}", name, tensor, (expert_id, which))
                elif m := _STACKED_NAME.match(name):
                    param = "w13_weight" if m.group(2) == "gate_up_proj" else "w2_weight"
                    load(f"{m.group(1)}.block_sparse_moe.{param}", name, tensor, m.group(2))
                else:
                    yield name.replace(".mlp.gate.", ".block_sparse_moe.gate."), tensor

        return super().load_weights(others()) | loaded
