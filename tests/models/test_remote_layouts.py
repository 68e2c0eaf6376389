"""Remote-code layouts (InternLM, Aquila, Baichuan-7B/13B, original Qwen) loaded natively.

Each tiny checkpoint is an HF-native model (Llama / Qwen2) whose tensors are renamed or
fused into the remote layout and saved with a config.json that only remote code could read
(unknown model_type, remote field names). Greedy tokens must equal the HF-native model's.

Baichuan-13B (ALiBi instead of RoPE) has no HF-native equivalent, so its checkpoint (a
Llama's weights in its layout) is checked against `DenseBaichuan13B`, an explicit dense
implementation of its forward pass written here.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from pagedlm import LLM, SamplingParams
from tests.helpers import assert_matches_hf, check_greedy_match, hf_greedy, hf_logprobs_along

PROMPTS = [[1, 17, 300, 42, 7], [5, 99, 99, 120, 4, 8, 15, 16, 23, 42, 250, 3], list(range(3, 30)), [77]]
MAX_TOKENS = 10
BASE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=128, initializer_range=0.08, tie_word_embeddings=False, rope_theta=5000.0,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
LLAMA_FIELDS = {k: v for k, v in BASE.items() if k != "initializer_range"}


def _internlm(sd: dict) -> tuple[dict, dict]:
    return sd, {"model_type": "internlm", "architectures": ["InternLMForCausalLM"], "bias": True, **LLAMA_FIELDS}


def _aquila(sd: dict) -> tuple[dict, dict]:
    return sd, {"model_type": "aquila", "architectures": ["AquilaModel"], "num_key_value_heads": 2, **LLAMA_FIELDS}


def _baichuan(sd: dict) -> tuple[dict, dict]:
    out = {}
    for name, t in sd.items():
        if ".q_proj." in name:
            k, v = sd[name.replace("q_proj", "k_proj")], sd[name.replace("q_proj", "v_proj")]
            out[name.replace("q_proj", "W_pack")] = torch.cat([t, k, v])
        elif ".k_proj." not in name and ".v_proj." not in name:
            out[name] = t
    return out, {"model_type": "baichuan", "architectures": ["BaichuanForCausalLM"], **LLAMA_FIELDS}


def _qwen(sd: dict) -> tuple[dict, dict]:
    renames = [("model.embed_tokens.", "transformer.wte."), ("model.norm.", "transformer.ln_f."),
               ("model.layers.", "transformer.h."), (".input_layernorm.", ".ln_1."),
               (".post_attention_layernorm.", ".ln_2."), (".self_attn.o_proj.", ".attn.c_proj."),
               (".mlp.gate_proj.", ".mlp.w2."), (".mlp.up_proj.", ".mlp.w1."), (".mlp.down_proj.", ".mlp.c_proj.")]
    out = {}
    for name, t in sd.items():
        if ".k_proj." in name or ".v_proj." in name:
            continue
        if ".q_proj." in name:
            parts = [sd[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            name, t = name.replace("self_attn.q_proj", "attn.c_attn"), torch.cat(parts)
        for old, new in renames:
            name = name.replace(old, new)
        out[name] = t
    config = {
        "model_type": "qwen", "architectures": ["QWenLMHeadModel"], "auto_map": {"AutoConfig": "x.QWenConfig"},
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "kv_channels": 16, "layer_norm_epsilon": 1e-6, "rotary_emb_base": 5000,
        "rotary_pct": 1.0, "seq_length": 128, "no_bias": True, "use_dynamic_ntk": True, "use_logn_attn": True,
        "tie_word_embeddings": False,
    }
    return out, config


VARIANTS = {  # name -> (HF family, HF overrides, to remote layout)
    "internlm": ("Llama", dict(attention_bias=True), _internlm),
    "aquila": ("Llama", dict(num_key_value_heads=2), _aquila),
    "baichuan": ("Llama", {}, _baichuan),
    "qwen": ("Qwen2", dict(num_key_value_heads=4, max_position_embeddings=128), _qwen),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import transformers

    def make(name: str) -> tuple[str, torch.nn.Module]:
        family, overrides, to_remote = VARIANTS[name]
        torch.manual_seed(0)
        config = getattr(transformers, f"{family}Config")(**{**BASE, **overrides})
        model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
        with torch.no_grad():  # HF inits norms to 1 and biases to 0: make them count
            for pname, param in model.named_parameters():
                if "norm" in pname:
                    param.uniform_(0.5, 1.5)
                elif pname.endswith("bias"):
                    param.normal_(0.0, 0.05)
        tensors, remote_config = to_remote({k: v.contiguous() for k, v in model.state_dict().items()})
        path = tmp_path_factory.mktemp(name)
        save_file(tensors, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(remote_config))
        return str(path), model

    return make


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, skip_tokenizer_init=True, block_size=4, kv_cache_memory=1 << 22, **kwargs)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_equals_hf_native(tiny, name):
    path, hf = tiny(name)
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for extra in ({}, {"max_num_batched_tokens": 7}):  # batched, then chunked prefill
        outputs = _llm(path, **extra).generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        for prompt, out, ref in zip(PROMPTS, outputs, refs):
            ours = out.outputs[0].token_ids
            assert len(ours) == MAX_TOKENS
            check_greedy_match(ours, ref, hf_logprobs_along(hf, prompt, ref), len(prompt),
                               context=f"{name} {extra}")


def _config_dir(tmp_path, config: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


# Baichuan-13B's config.json: ALiBi, so `model_max_length` and no max_position_embeddings.
BAICHUAN_13B = {"model_type": "baichuan", "architectures": ["BaichuanForCausalLM"], "vocab_size": 64000,
                "hidden_size": 5120, "intermediate_size": 13696, "num_hidden_layers": 40,
                "num_attention_heads": 40, "model_max_length": 4096, "rms_norm_eps": 1e-6,
                "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def bloom_slopes(num_heads: int) -> list[float]:
    """ALiBi slopes as BLOOM (and Baichuan-13B's `_get_interleave`) define them: for a power
    of two n, start = 2^(-8/n) and slope_h = start^(h+1); otherwise the slopes of the largest
    power of two p < n, then every other slope of the 2p-head sequence."""
    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (h + 1) for h in range(n)]

    p = 2 ** math.floor(math.log2(num_heads))
    return power_of_2(p) + power_of_2(2 * p)[0::2][: num_heads - p]


class DenseBaichuan13B(torch.nn.Module):
    """Baichuan-13B's forward pass on a whole sequence, written out densely from its
    checkpoint tensors: RMSNorm -> W_pack -> softmax(q k^T / sqrt(d) + slope_h * j, causal)
    -> o_proj, RMSNorm -> SiLU-gated MLP, both residual; final RMSNorm, lm_head. It has the
    two entry points the HF comparison helpers use: `model(ids).logits` and a greedy
    `generate`."""

    def __init__(self, tensors: dict, config: dict) -> None:
        super().__init__()
        self.w = {k: v.double() for k, v in tensors.items()}
        self.heads = config["num_attention_heads"]
        self.layers = config["num_hidden_layers"]
        self.eps = config["rms_norm_eps"]
        self.slopes = torch.tensor(bloom_slopes(self.heads), dtype=torch.float64)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        w, n = self.w, input_ids.shape[1]
        x = w["model.embed_tokens.weight"][input_ids[0]]  # [n, hidden]
        j = torch.arange(n, dtype=torch.float64)
        bias = self.slopes[:, None, None] * j[None, None, :]  # [heads, 1, n]: slope_h * j
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        for layer in range(self.layers):
            pre = f"model.layers.{layer}."
            h = self._norm(x, pre + "input_layernorm.weight")
            q, k, v = (h @ w[pre + "self_attn.W_pack.weight"].T).chunk(3, dim=-1)
            q, k, v = (t.view(n, self.heads, -1).transpose(0, 1) for t in (q, k, v))  # [heads, n, d]
            scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]) + bias  # [heads, n, n]
            probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            o = (probs @ v).transpose(0, 1).reshape(n, -1)
            x = x + o @ w[pre + "self_attn.o_proj.weight"].T
            h = self._norm(x, pre + "post_attention_layernorm.weight")
            gated = F.silu(h @ w[pre + "mlp.gate_proj.weight"].T) * (h @ w[pre + "mlp.up_proj.weight"].T)
            x = x + gated @ w[pre + "mlp.down_proj.weight"].T
        x = self._norm(x, "model.norm.weight")
        return SimpleNamespace(logits=(x @ w["lm_head.weight"].T)[None])  # [1, n, vocab]

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **_) -> torch.Tensor:
        ids = input_ids
        for _step in range(max_new_tokens):
            next_id = self(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
        return ids


@pytest.fixture(scope="module")
def baichuan_13b(tmp_path_factory) -> tuple[str, DenseBaichuan13B]:
    """A tiny Baichuan-13B checkpoint (6 heads: the non-power-of-two slopes) from a random
    Llama's weights, and the dense reference on the same tensors."""
    import transformers

    torch.manual_seed(0)
    shape = dict(hidden_size=96, num_attention_heads=6, intermediate_size=128, num_hidden_layers=2)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**BASE, **shape})).eval()
    with torch.no_grad():
        for pname, param in llama.named_parameters():
            if "norm" in pname:
                param.uniform_(0.5, 1.5)
    tensors, _ = _baichuan({k: v.contiguous() for k, v in llama.state_dict().items()})
    tensors = {k: v for k, v in tensors.items() if "rotary_emb" not in k}
    config = {**BAICHUAN_13B, **shape, "vocab_size": BASE["vocab_size"], "model_max_length": 128}
    path = tmp_path_factory.mktemp("baichuan13b")
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return str(path), DenseBaichuan13B(tensors, config)


def test_bloom_slopes_match_ours():
    from pagedlm.attention.alibi import alibi_slopes

    for n in (4, 6, 40):  # 40: Baichuan-13B's heads
        torch.testing.assert_close(alibi_slopes(n), torch.tensor(bloom_slopes(n), dtype=torch.float32))


def test_baichuan_13b_alibi_equals_dense_reference(baichuan_13b):
    path, reference = baichuan_13b
    assert_matches_hf(path, reference, PROMPTS, MAX_TOKENS, context="baichuan-13b")


def test_baichuan_uses_alibi_rule():
    from pagedlm.models.remote_configs import remote_config_from_dict, uses_alibi

    assert uses_alibi(BAICHUAN_13B) and not uses_alibi(_baichuan({})[1])
    config = remote_config_from_dict(BAICHUAN_13B)
    assert config.position_embedding == "alibi" and config.max_position_embeddings == 4096
    assert remote_config_from_dict(_baichuan({})[1]).position_embedding == "rope"


def test_unknown_model_type_lists_supported_architectures(tmp_path):
    config = {"model_type": "mystery", "architectures": ["MysteryForCausalLM"], "vocab_size": 8}
    with pytest.raises(ValueError, match="not supported; supported architectures: .*InternLMForCausalLM"):
        _llm(_config_dir(tmp_path, config))


def test_remote_configs_map_fields():
    from pagedlm.models.remote_configs import remote_config_from_dict

    qwen = remote_config_from_dict(_qwen({})[1] | {"vocab_size": 151936})
    assert (qwen.intermediate_size, qwen.head_dim, qwen.max_position_embeddings) == (128, 16, 128)
    assert qwen.rope_parameters["rope_theta"] == 5000 and qwen.eos_token_id == 151643
    assert qwen.architectures == ["QWenLMHeadModel"]
    internlm = remote_config_from_dict(_internlm({})[1])
    assert internlm.attention_bias and internlm.eos_token_id == 2
