"""Engine steps of a Llama-family model on CPU in one C++ call (pagedlm/csrc/llama_decode_cpu.cpp).

At decode sizes a decoder layer's dozen module calls and torch ops cost more in Python
and dispatch than in arithmetic: on SmolLM2-135M with `weight_dtype='q8'`, a batch-1
step takes 25.3 ms through the Python layers and 12.2 ms through this decoder
(`pagedlm bench latency --batch-size 1`, with and without `--enforce-eager`). The C++ decoder runs the same kernels
the layers call (the q8, float32 / float16 panel and GGUF-block matmuls, fused RMSNorm /
rotary / SiLU, the paged decode and prefill attention kernels) in the same order, so its
hidden states equal the layers' float for float; the Python layers stay the reference
(tests/test_llama_cpu_decode.py).

It takes every pure-decode step, and every step of up to `MAX_STEP_TOKENS` tokens with
prefill chunks in it: a server's steps of decodes next to a bounded prompt chunk, and
speculative verification steps. Longer steps (a whole batch of prompts at once) run the
Python layers, whose dispatch is then a small part of the step, without the decoder
holding activation buffers that large from then on.

Only models whose forward is exactly models/llama.py's qualify: `LlamaCpuDecoder.build`
returns None with the reason otherwise (another layer class, a matmul other than those
(fbgemm's float16 GEMM, plain F.linear), a backend other than the CPU kernels, ALiBi, a
soft cap, a rotary the kernel does not do). Under tensor parallelism each
rank's decoder sums its o_proj and down_proj outputs over the ranks through the
shared-memory all-reduce the Python layers use (ranks on one machine; not across machines).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from pagedlm.attention.cpu_kernels import prefill_kernel_supports
from pagedlm.attention.cpu_paged import CpuPagedAttention
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.csrc import load_extension
from pagedlm.layers.activation import SiluAndMul
from pagedlm.layers.attention import FP8_MAX
from pagedlm.layers.embedding import VocabParallelEmbedding
from pagedlm.layers.norm import RMSNorm
from pagedlm.layers.panel_weights import PanelWeightMatmul
from pagedlm.layers.parallel_state import get_tp_group, shm_all_reduce
from pagedlm.layers.q8_weights import Q8WeightMatmul
from pagedlm.layers.quant_block_weights import QuantBlockMatmul
from pagedlm.layers.rotary import RotaryEmbedding
from pagedlm.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)

# The most tokens of a step with prefills in it that the decoder takes. Its activation
# buffers grow to the largest step it has run and stay (about 30 KB a token for
# SmolLM2-135M, 270 KB for a 7B Llama); past a few hundred tokens the Python layers'
# dispatch is a few percent of the step (benchmarks/cpu/step_kinds.py).
MAX_STEP_TOKENS = 512


def _why_not(model) -> str | None:
    """None if the C++ decoder computes exactly what `model.forward` does, else why not."""
    if not isinstance(model, LlamaForCausalLM) or type(model).forward is not LlamaForCausalLM.forward:
        return f"{type(model).__name__} is not a Llama-family model with Llama's forward"
    inner = model.model
    if type(inner) is not LlamaModel or type(inner.embed_tokens) is not VocabParallelEmbedding:
        return "the model body is not models/llama.py's LlamaModel"
    if get_tp_group().size != 1 and shm_all_reduce() is None:
        return "tensor parallelism across machines (its sums are not in shared memory)"
    if type(inner.norm) is not RMSNorm or inner.norm.weight.dtype != torch.float32:
        return "the final norm is not a float32 RMSNorm"
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if (type(layer) is not LlamaDecoderLayer or type(attn) is not LlamaAttention
                or type(mlp) is not LlamaMLP or type(mlp.act_fn) is not SiluAndMul):
            return f"layer {i} is not Llama's attention + SiLU MLP"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(n) is not RMSNorm or n.weight.dtype != torch.float32 for n in norms):
            return f"layer {i}: a norm is not a float32 RMSNorm"
        if any(n.eps != inner.norm.eps for n in norms):
            return f"layer {i}: a norm's eps differs from the final norm's"
        rotary = attn.rotary_emb
        if rotary is not inner.layers[0].self_attn.rotary_emb:
            return f"layer {i} has a rotary embedding of its own"
        if type(rotary) is not RotaryEmbedding or not rotary._fusable:
            return f"layer {i}: a rotary embedding the fused kernel does not do"
        a = attn.attn
        if not isinstance(a.backend, CpuPagedAttention):
            return f"layer {i}: attention backend {type(a.backend).__name__}, not the CPU kernels"
        if a.alibi_slopes is not None or a.logits_soft_cap is not None:
            return f"layer {i}: ALiBi or a logits soft cap"
        if a.k_cache is None or a.k_cache.device.type != "cpu":
            return f"layer {i}: no CPU KV cache bound"
        for name, lin in (("qkv_proj", attn.qkv_proj), ("o_proj", attn.o_proj),
                          ("gate_up_proj", mlp.gate_up_proj), ("down_proj", mlp.down_proj)):
            if _linear_kind(lin.weight_kernel) is None:
                return (f"layer {i}: {name} multiplies with {type(lin.weight_kernel).__name__}, not the "
                        "q8, panel or GGUF-block kernels")
            if lin.bias is not None and lin.bias.dtype != torch.float32:
                return f"layer {i}: {name} has a {lin.bias.dtype} bias"
            if (lin.bias is not None and get_tp_group().size != 1
                    and name in ("o_proj", "down_proj")):
                return f"layer {i}: {name} has a bias, added once after the ranks' sum"
    return None


def _linear_kind(kernel) -> str | None:
    """Which of the C++ decoder's matmuls computes what a layer's `weight_kernel` computes,
    if any (None: F.linear, or a format the decoder does not know)."""
    if isinstance(kernel, Q8WeightMatmul):
        return "q8"
    if isinstance(kernel, PanelWeightMatmul):
        return "panel"
    if isinstance(kernel, QuantBlockMatmul) and isinstance(kernel.fallback, PanelWeightMatmul):
        return "block"
    return None


def _linear(kernels, lin):
    """The C++ decoder's form of linear layer `lin`'s matmul (see `_linear_kind`)."""
    mm = lin.weight_kernel
    bias = None if lin.bias is None else lin.bias.data
    kind = _linear_kind(mm)
    if kind == "q8":
        return kernels.Linear.q8(mm.packed, mm.scales, mm.out_features, mm.q4_1, bias)
    if kind == "panel":
        return kernels.Linear.panel(mm.panels, mm.out_features, bias)
    return kernels.Linear.block(mm.blocks, mm.ggml_type == GGMLQuantizationType.Q4_1, mm.max_rows,
                                mm.fallback.panels, mm.out_features, bias)


class LlamaCpuDecoder:
    """`model.forward` for a step, in one C++ call: see `takes`."""

    def __init__(self, model, kernels) -> None:
        inner = model.model
        attn0 = inner.layers[0].self_attn
        rotary = attn0.rotary_emb
        self.embed_tokens = inner.embed_tokens
        # Prefill chunks need the prefill kernel for this head size (the Python backend
        # otherwise runs them through torch: attention/cpu_paged.py).
        self.takes_prefills = prefill_kernel_supports(attn0.head_dim)
        self._lora_layers: list = []
        self.decoder = kernels.LlamaDecoder(
            attn0.num_heads, attn0.num_kv_heads, attn0.head_dim, float(inner.norm.eps),
            rotary.cos_cache, rotary.sin_cache, inner.norm.weight.data,
        )
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            a = attn.attn
            fp8_max = FP8_MAX.get(a.k_cache.dtype)
            # As layers/attention.py computes them: a float8 cache's softmax scale is
            # scale * k_scale (a Python float), its output is multiplied by v_scale.
            self.decoder.add_layer(
                layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data,
                [_linear(kernels, lin) for lin in linears], int(a.sliding_window or 0),
                a.k_cache, a.v_cache, a.scale * a.k_scale if fp8_max else a.scale,
                a.k_scale_inv, a.v_scale_inv, a.v_scale, fp8_max or 0.0,
            )

            for which, lin in enumerate(linears):
                if lin.lora is not None:  # LoRA slots: the layer's own tensors
                    w = lin.lora
                    self.decoder.set_lora(len(self._lora_layers), which, w.a, w.b, w.bounds,
                                          w.ranks)
            self._lora_layers.append(layer)

        # Tensor parallel: the decoder continues the shared-memory all-reduce's rounds.
        self.comm = shm_all_reduce() if get_tp_group().size > 1 else None
        if self.comm is not None:
            self.decoder.set_all_reduce(self.comm.segment, self.comm.rank, self.comm.world_size,
                                        self.comm.chunk, self.comm.timeout_ms)

    @classmethod
    def build(cls, model) -> tuple[LlamaCpuDecoder | None, str]:
        """The decoder for `model` (KV cache bound), or None and why it does not qualify."""
        reason = _why_not(model)
        if reason is not None:
            return None, reason
        kernels = load_extension("llama_decode_cpu")
        if kernels is None:
            return None, "the C++ kernels are not built"
        return cls(model, kernels), "every decoder layer"

    def takes(self, meta: AttentionMetadata) -> bool:
        """Whether the decoder runs this step: every pure-decode step, and steps with prefill
        chunks of up to MAX_STEP_TOKENS tokens."""
        return meta.num_prefills == 0 or (meta.num_tokens <= MAX_STEP_TOKENS
                                          and self.takes_prefills)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, lora_slots: torch.Tensor | None = None
                 ) -> torch.Tensor:  # [num_tokens, hidden]
        """A step `takes` accepts. `lora_slots`: [num_tokens] int32 adapter slot per token
        (-1: none), or None."""
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        self.decoder.set_lora_slots(lora_slots)
        # A pure-decode step needs no query offsets: one token per sequence.
        query_start = meta.query_start_loc_cpu if meta.num_prefills else []
        args = (x.contiguous(), positions.contiguous(), meta.slot_mapping.contiguous(),
                meta.block_tables.contiguous(), meta.seq_lens_cpu, meta.num_decodes, query_start)
        if self.comm is None:
            return self.decoder.forward(*args)
        self.decoder.set_round(self.comm.round)
        try:
            return self.decoder.forward(*args)
        finally:
            self.comm.round = self.decoder.round()
