"""Remote-code layouts (InternLM, Aquila, Baichuan-7B, original Qwen) loaded natively.

Each tiny checkpoint is an HF-native model (Llama / Qwen2) whose tensors are renamed or
fused into the remote layout and saved with a config.json that only remote code could read
(unknown model_type, remote field names). Greedy tokens must equal the HF-native model's.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pagedlm import LLM, SamplingParams
from tests.helpers import check_greedy_match, hf_greedy, hf_logprobs_along

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


def test_alibi_baichuan_rejected(tmp_path):
    # Baichuan-13B: ALiBi, so model_max_length and no max_position_embeddings
    config = {"model_type": "baichuan", "architectures": ["BaichuanForCausalLM"], "vocab_size": 64000,
              "hidden_size": 5120, "intermediate_size": 13696, "num_hidden_layers": 40,
              "num_attention_heads": 40, "model_max_length": 4096, "rms_norm_eps": 1e-6}
    with pytest.raises(ValueError, match="ALiBi"):
        _llm(_config_dir(tmp_path, config))


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
