"""Tests for pagedlm.loader: GGUF, safetensors, dummy weights, tokenizers."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from pagedlm.layers.quant_blocks import dequantize_raw
from pagedlm.loader.dummy import init_dummy_weights
from pagedlm.loader.gguf_format import unpermute_qk
from pagedlm.loader.gguf_loader import GGUFCheckpoint, default_model_path
from pagedlm.loader.safetensors_loader import iterate_safetensors, list_safetensors_files
from pagedlm.loader.tokenizer import gguf_tokenizer, load_tokenizer
from tests.helpers import write_tiny_tokenizer

transformers = pytest.importorskip("transformers")

# Tiny Llama geometry shared by the GGUF and safetensors tests. in_features are multiples of 32
# so every matrix can be Q8_0-quantised.
TINY = dict(
    vocab_size=260,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

# HF module path -> llama.cpp tensor stem, written out independently of the loader's table.
_HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    parts = hf_name.split(".")  # model.layers.<i>.<module...>.<weight|bias>
    return f"blk.{parts[2]}.{_HF_TO_GGUF_BLOCK['.'.join(parts[3:-1])]}.{parts[-1]}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter step for Llama Q/K rows: per head, the two halves of the head
    dimension [x_0..x_{D/2-1} | y_0..y_{D/2-1}] become interleaved pairs [x_0, y_0, x_1, y_1, ...]."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    state_dict: dict[str, torch.Tensor],
    *,
    arch: str = "llama",
    permute: bool = True,
    qtype: QT | None = None,
    extra: dict[str, float | int | str] | None = None,
    n_head: int = TINY["num_attention_heads"],
    n_head_kv: int = TINY["num_key_value_heads"],
    gguf_name=_gguf_name,
) -> None:
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny test model")
    w.add_context_length(TINY["max_position_embeddings"])
    w.add_embedding_length(TINY["hidden_size"])
    w.add_block_count(TINY["num_hidden_layers"])
    w.add_feed_forward_length(TINY["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(TINY["head_dim"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(TINY["rms_norm_eps"])
    w.add_vocab_size(TINY["vocab_size"])
    write_tiny_tokenizer(w)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    for name, tensor in state_dict.items():
        a = tensor.detach().float().numpy()
        if permute and ".q_proj." in name:
            a = llama_cpp_permute(a, n_head)
        elif permute and ".k_proj." in name:
            a = llama_cpp_permute(a, n_head_kv)
        if qtype is not None and a.ndim == 2:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny_gguf_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama: torch.nn.Module) -> Path:
    d = tmp_path_factory.mktemp("gguf")
    sd = tiny_llama.state_dict()
    write_tiny_gguf(d / "tiny-f32.gguf", sd)
    write_tiny_gguf(d / "tiny-q8_0.gguf", sd, qtype=QT.Q8_0)
    return d


# ---------------------------------------------------------------------------------------------
# Q/K permutation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n_head", "head_dim", "cols"), [(4, 16, 64), (2, 16, 64), (9, 64, 3), (3, 8, None)]
)
def test_unpermute_inverts_llama_cpp_permutation(
    n_head: int, head_dim: int, cols: int | None
) -> None:
    shape = (n_head * head_dim,) if cols is None else (n_head * head_dim, cols)
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    permuted = llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_qk(permuted, n_head), w)
    # Same result through torch.
    torch.testing.assert_close(
        unpermute_qk(torch.from_numpy(permuted), n_head), torch.from_numpy(w)
    )


def _rope_rotate_half(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """HF Llama rotary: element i of a head pairs with element i + D/2."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def _rope_interleaved(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """ggml's llama ("NORM") rotary: elements 2i and 2i+1 of a head form a pair."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def test_permutation_turns_rotate_half_rope_into_interleaved_rope() -> None:
    """Why the permutation exists, checked numerically: interleaved rope applied to the permuted
    projection equals rotate-half rope applied to the HF projection, up to the same row order.
    So un-permuted GGUF weights + HF rope reproduce llama.cpp's computation."""
    n_head, head_dim, hidden, t = 3, 8, 12, 5
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n_head * head_dim, hidden, generator=g, dtype=torch.float64)
    x = torch.randn(t, hidden, generator=g, dtype=torch.float64)
    pos = torch.arange(t, dtype=torch.float64) * 7
    hf = _rope_rotate_half((x @ w.T).view(t, n_head, head_dim), pos, 10000.0)
    w_gguf = torch.from_numpy(llama_cpp_permute(w.numpy(), n_head))
    ggml = _rope_interleaved((x @ w_gguf.T).view(t, n_head, head_dim), pos, 10000.0)
    back = unpermute_qk(ggml.reshape(t, -1).T.contiguous(), n_head).T.reshape(t, n_head, head_dim)
    torch.testing.assert_close(back, hf)
    # Attention logits (what the model actually consumes) agree without any reordering.
    torch.testing.assert_close(ggml @ ggml.transpose(-1, -2), hf @ hf.transpose(-1, -2))


# ---------------------------------------------------------------------------------------------
# Dequantisation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.BF16, QT.F16, QT.F32])
def test_dequantize_matches_gguf_reference(qtype: QT) -> None:
    data = np.random.default_rng(int(qtype)).standard_normal((6, 96)).astype(np.float32) * 3
    if qtype == QT.F32:
        raw = data.view(np.uint8)
    elif qtype == QT.F16:
        raw = data.astype(np.float16).view(np.uint8)
    else:
        raw = gguf.quants.quantize(data, qtype)
    expected = gguf.quants.dequantize(raw, qtype).reshape(6, 96)
    got = dequantize_raw(np.ascontiguousarray(raw).reshape(-1), qtype, (6, 96))
    assert got.dtype == np.float32 and got.shape == (6, 96)
    np.testing.assert_array_equal(got, expected)
    assert not np.shares_memory(got, raw)


# ---------------------------------------------------------------------------------------------
# Tiny GGUF round trips
# ---------------------------------------------------------------------------------------------


def test_tiny_gguf_f32_weights_equal_hf(tiny_gguf_dir: Path, tiny_llama: torch.nn.Module) -> None:
    with GGUFCheckpoint(tiny_gguf_dir / "tiny-f32.gguf") as ckpt:
        got = dict(ckpt.weights())
    expected = tiny_llama.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], tensor), name


def test_tiny_gguf_config(tiny_gguf_dir: Path) -> None:
    with GGUFCheckpoint(tiny_gguf_dir / "tiny-f32.gguf") as ckpt:
        config = ckpt.config
    assert isinstance(config, transformers.LlamaConfig)
    assert config.architectures == ["LlamaForCausalLM"]
    for key, value in TINY.items():
        assert getattr(config, key) == pytest.approx(value), key
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert config.tie_word_embeddings is False
    assert (config.bos_token_id, config.eos_token_id) == (256, 256)


def test_tiny_gguf_q8_0_weights_close_to_hf(
    tiny_gguf_dir: Path, tiny_llama: torch.nn.Module
) -> None:
    with GGUFCheckpoint(tiny_gguf_dir / "tiny-q8_0.gguf") as ckpt:
        got = dict(ckpt.weights())
        embed_info = ckpt.tensor_infos["token_embd.weight"]
        assert embed_info.ggml_type == QT.Q8_0
        assert embed_info.shape == (TINY["vocab_size"], TINY["hidden_size"])
    for name, tensor in tiny_llama.state_dict().items():
        if tensor.ndim == 1:
            assert torch.equal(got[name], tensor), name
        else:
            # Q8_0: per-32-block absmax / 127 step, so error <= half a step.
            tol = tensor.abs().max().item() / 127
            torch.testing.assert_close(got[name], tensor, atol=tol, rtol=0, msg=name)


@pytest.mark.parametrize("fname", ["tiny-f32.gguf", "tiny-q8_0.gguf"])
def test_tiny_gguf_matches_transformers_loader(tiny_gguf_dir: Path, fname: str) -> None:
    try:
        ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_gguf_dir, gguf_file=fname)
    except Exception as exc:  # pragma: no cover - depends on the installed transformers
        pytest.skip(f"transformers cannot load GGUF offline here: {exc}")
    with GGUFCheckpoint(tiny_gguf_dir / fname) as ckpt:
        got = dict(ckpt.weights())
    for name, tensor in ref.state_dict().items():
        torch.testing.assert_close(got[name], tensor.float(), atol=0, rtol=0, msg=name)


def test_tiny_gguf_tokenizer_matches_transformers(tiny_gguf_dir: Path) -> None:
    with GGUFCheckpoint(tiny_gguf_dir / "tiny-f32.gguf") as ckpt:
        tok = gguf_tokenizer(ckpt)
        assert gguf_tokenizer(ckpt) is tok  # built once
    ref = transformers.AutoTokenizer.from_pretrained(tiny_gguf_dir, gguf_file="tiny-f32.gguf")
    text = "hello world, hello<|endoftext|> wow\n"
    assert tok(text).input_ids == ref(text).input_ids
    assert tok.decode(tok(text).input_ids) == text
    assert tok.eos_token == "<|endoftext|>"
    assert tok.chat_template is not None


def test_gguf_rope_scaling_and_unsupported_arch(
    tmp_path: Path, tiny_llama: torch.nn.Module
) -> None:
    sd = {k: v for k, v in tiny_llama.state_dict().items() if k != "lm_head.weight"}
    extra = {
        "llama.rope.scaling.type": "linear",
        "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 64,
    }
    write_tiny_gguf(tmp_path / "scaled.gguf", sd, extra=extra)
    with GGUFCheckpoint(tmp_path / "scaled.gguf") as ckpt:
        cfg = ckpt.config
        assert cfg.tie_word_embeddings is True  # no output.weight tensor
        assert "lm_head.weight" not in dict(ckpt.weights())
    assert cfg.rope_parameters == {
        "rope_type": "linear",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    }

    write_tiny_gguf(tmp_path / "odd.gguf", {"model.norm.weight": torch.ones(4)}, arch="mamba")
    with (
        GGUFCheckpoint(tmp_path / "odd.gguf") as ckpt,
        pytest.raises(ValueError, match="mamba.*llama"),
    ):
        _ = ckpt.config

    (tmp_path / "junk.gguf").write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="magic"):
        GGUFCheckpoint(tmp_path / "junk.gguf")


def test_qwen2_gguf_is_not_unpermuted(tmp_path: Path) -> None:
    config = transformers.Qwen2Config(**TINY, tie_word_embeddings=True)
    torch.manual_seed(1)
    model = transformers.Qwen2ForCausalLM(config)
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    write_tiny_gguf(tmp_path / "qwen2.gguf", sd, arch="qwen2", permute=False)
    with GGUFCheckpoint(tmp_path / "qwen2.gguf") as ckpt:
        assert isinstance(ckpt.config, transformers.Qwen2Config)
        assert ckpt.config.architectures == ["Qwen2ForCausalLM"]
        got = dict(ckpt.weights())
    assert "model.layers.0.self_attn.q_proj.bias" in got
    assert set(got) == set(sd)
    for name, tensor in sd.items():
        assert torch.equal(got[name], tensor), name


_GEMMA_TO_GGUF_BLOCK = {
    **_HF_TO_GGUF_BLOCK,
    "pre_feedforward_layernorm": "ffn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def _gemma_gguf_name(hf_name: str) -> str:
    if not hf_name.startswith("model.layers."):
        return _gguf_name(hf_name)
    parts = hf_name.split(".")
    return f"blk.{parts[2]}.{_GEMMA_TO_GGUF_BLOCK['.'.join(parts[3:-1])]}.{parts[-1]}"


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_names_norm_shift_and_config(tmp_path: Path, arch: str) -> None:
    extra: dict[str, float | int | str] = {f"{arch}.attention.sliding_window": 8, f"{arch}.attention.key_length": 16}
    if arch == "gemma2":
        config = transformers.Gemma2Config(**TINY, query_pre_attn_scalar=16, sliding_window=8)
        model = transformers.Gemma2ForCausalLM(config)
        extra.update({"gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0})
    else:
        config = transformers.Gemma3TextConfig(**TINY, query_pre_attn_scalar=16, sliding_window=8)
        model = transformers.Gemma3ForCausalLM(config)
        extra.update({"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0})
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5)
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    # llama.cpp's converter stores Gemma norm weights as 1 + w
    stored = {k: v + 1 if k.endswith("norm.weight") else v for k, v in sd.items()}
    write_tiny_gguf(tmp_path / "gemma.gguf", stored, arch=arch, permute=False, extra=extra,
                    gguf_name=_gemma_gguf_name)
    with GGUFCheckpoint(tmp_path / "gemma.gguf") as ckpt:
        cfg = ckpt.config
        got = dict(ckpt.weights())
    assert type(cfg) is type(config) and cfg.architectures == [type(model).__name__]
    assert (cfg.sliding_window, cfg.head_dim, cfg.query_pre_attn_scalar) == (8, 16, 16)
    assert cfg.tie_word_embeddings is True
    if arch == "gemma2":
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
        assert cfg.layer_types == ["sliding_attention", "full_attention"]  # alternating
    else:
        assert cfg.layer_types == ["sliding_attention"] * 2  # every 6th layer is global
        assert cfg.rope_parameters["full_attention"] == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 8.0}
        assert cfg.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert set(got) == set(sd)
    for name, tensor in sd.items():  # (w + 1) - 1 in float32: within an ulp of 1
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=2e-7, msg=name)


@pytest.mark.parametrize("qtype", [QT.Q5_0, QT.Q5_1, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K])
def test_dequantize_random_blocks_match_gguf_reference(qtype: QT) -> None:
    """Every bit pattern of the quantised fields (gguf cannot quantise to these types), with
    finite fp16 scales, against the gguf library's reference dequantisation."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    fp16_fields = {QT.Q5_0: [0], QT.Q5_1: [0, 2], QT.Q2_K: [80, 82], QT.Q3_K: [108],
                   QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208]}[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(24, type_size), dtype=np.uint8)
    for start in fp16_fields:
        raw[:, start : start + 2] = rng.uniform(-2, 2, (24, 1)).astype(np.float16).view(np.uint8)
    shape = (3, 8 * block_size)
    expected = gguf.quants.dequantize(raw.reshape(3, -1), qtype).reshape(shape)
    got = dequantize_raw(raw.reshape(-1), qtype, shape)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)


def test_gemma_merges_equal_transformers() -> None:
    from transformers.tokenization_utils_base import generate_merges

    from pagedlm.loader.gguf_tokenizer import _gemma_merges

    tokens = ["<pad>", "a", "b", "c", "ab", "bc", "abc", "\u2581", "\u2581a", "ca", "abca", "bca"]
    vocab = {t: i for i, t in enumerate(tokens)}
    assert _gemma_merges(vocab) == generate_merges(vocab, {t: -i for i, t in enumerate(tokens)})


# ---------------------------------------------------------------------------------------------
# SmolLM2 (the embedded default model)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> GGUFCheckpoint:
    try:
        path = default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return GGUFCheckpoint(path)


@pytest.fixture(scope="module")
def smollm2_weights(smollm2: GGUFCheckpoint) -> dict[str, torch.Tensor]:
    return dict(smollm2.weights())


def test_smollm2_config(smollm2: GGUFCheckpoint) -> None:
    c = smollm2.config
    assert isinstance(c, transformers.LlamaConfig)
    assert c.architectures == ["LlamaForCausalLM"]
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (576, 1536, 30)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.max_position_embeddings) == (49152, 8192)
    assert c.rope_parameters["rope_theta"] == 100000.0
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.tie_word_embeddings is True
    assert (c.bos_token_id, c.eos_token_id) == (1, 2)


def test_smollm2_all_tensors(
    smollm2: GGUFCheckpoint, smollm2_weights: dict[str, torch.Tensor]
) -> None:
    assert len(smollm2.tensor_infos) == 272
    with torch.device("meta"):
        reference = transformers.LlamaForCausalLM(smollm2.config)
    expected = {
        k: tuple(v.shape) for k, v in reference.state_dict().items() if k != "lm_head.weight"
    }
    assert {k: tuple(v.shape) for k, v in smollm2_weights.items()} == expected
    assert all(
        # numpy, not torch: single-threaded beats torch's pool on a busy 2-core box.
        v.dtype == torch.float32 and np.isfinite(v.numpy()).all()
        for v in smollm2_weights.values()
    )


def test_smollm2_fast_dequant_equals_gguf(smollm2: GGUFCheckpoint) -> None:
    for name in ("blk.0.ffn_down.weight", "token_embd.weight"):  # Q4_1 and Q8_0
        info = smollm2.tensor_infos[name]
        raw = smollm2.read_raw(name)
        rows = raw.reshape(info.shape[0], -1)[:1024]  # the reference is slow; a slice will do
        expected = gguf.quants.dequantize(rows, info.ggml_type)
        np.testing.assert_array_equal(smollm2.read_array(name)[:1024], expected)


def test_smollm2_tokenizer(smollm2: GGUFCheckpoint) -> None:
    tok = gguf_tokenizer(smollm2)
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    assert len(tok) == 49152
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    text = "Hello world! The year 2024 — naïve café 🚀\n\tdef f(x): return x**2"
    ids = tok(text).input_ids
    assert ids[0] != tok.bos_token_id  # SmolLM2 adds no BOS
    assert tok.decode(ids) == text
    assert tok.tokenize("2024") == ["2", "0", "2", "4"]  # SmolLM splits every digit
    assert tok("<|im_start|>user").input_ids[0] == 1  # control tokens stay whole
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")


def test_load_tokenizer_paths(smollm2: GGUFCheckpoint, tmp_path: Path) -> None:
    tok = load_tokenizer(smollm2.path)
    text = "Paged attention, 42 times."
    hf_dir = tmp_path / "hf"
    tok.save_pretrained(hf_dir)
    again = load_tokenizer(hf_dir)
    assert again(text).input_ids == tok(text).input_ids
    assert again.chat_template == tok.chat_template
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="No tokenizer files"):
        load_tokenizer(empty)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")


@pytest.fixture(scope="module")
def smollm2_transformers(smollm2: GGUFCheckpoint) -> torch.nn.Module:
    path = Path(smollm2.path)
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.slow
def test_smollm2_matches_transformers(
    smollm2_transformers: torch.nn.Module, smollm2_weights: dict[str, torch.Tensor]
) -> None:
    ref = smollm2_transformers.state_dict()
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.29.self_attn.q_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.layers.29.post_attention_layernorm.weight",
        "model.norm.weight",
    ):
        torch.testing.assert_close(
            smollm2_weights[name], ref[name].float(), atol=0, rtol=0, msg=name
        )


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2: GGUFCheckpoint) -> None:
    path = Path(smollm2.path)
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = gguf_tokenizer(smollm2)
    # No digits: transformers' GGUF converter lacks SmolLM's split-every-digit rule (which the
    # HF tokenizer.json and llama.cpp both apply), so the two differ on numbers by design.
    text = "<|im_start|>user\nWhat's the capital of France?<|im_end|>\n  Naïve café, ok?!"
    assert ours(text).input_ids == ref(text).input_ids
    assert ours.chat_template == ref.chat_template
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)


# ---------------------------------------------------------------------------------------------
# Safetensors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shard", [None, "40KB"])
def test_safetensors_round_trip(
    tmp_path: Path, tiny_llama: torch.nn.Module, shard: str | None
) -> None:
    # transformers 5 always writes safetensors (the old `safe_serialization` flag is gone).
    kwargs = {} if shard is None else {"max_shard_size": shard}
    tiny_llama.save_pretrained(tmp_path, **kwargs)
    files = list_safetensors_files(tmp_path)
    assert (len(files) > 1) == (shard is not None)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shard is not None)
    got = dict(iterate_safetensors(tmp_path))
    expected = tiny_llama.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    halves = dict(iterate_safetensors(tmp_path, dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in halves.values())


def test_safetensors_index_is_honoured(tmp_path: Path, tiny_llama: torch.nn.Module) -> None:
    tiny_llama.save_pretrained(tmp_path, max_shard_size="40KB")
    # A stray duplicate not named by the index (like Mistral's consolidated.safetensors).
    (tmp_path / "consolidated.safetensors").write_bytes(
        (tmp_path / list_safetensors_files(tmp_path)[0].name).read_bytes()
    )
    assert "consolidated.safetensors" not in {f.name for f in list_safetensors_files(tmp_path)}
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["extra"] = "model-99-of-99.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-99-of-99"):
        list_safetensors_files(tmp_path)


def test_pickle_only_dir_refused(tmp_path: Path) -> None:
    # Never unpickled: the contents would explode if they were.
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="(?s)pickle.*safety"):
        list(iterate_safetensors(tmp_path))
    with pytest.raises(FileNotFoundError):
        list(iterate_safetensors(tmp_path / "nowhere"))


# ---------------------------------------------------------------------------------------------
# Dummy weights
# ---------------------------------------------------------------------------------------------


def _tiny_model() -> torch.nn.Module:
    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=False)
    with torch.device("cpu"):
        return transformers.LlamaForCausalLM(config)


def test_dummy_weights_deterministic_and_complete() -> None:
    a, b, c = _tiny_model(), _tiny_model(), _tiny_model()
    for model in (a, b, c):
        for p in model.parameters():
            p.data.fill_(7.0)  # a value init_dummy_weights can never produce
    init_dummy_weights(a, seed=3)
    init_dummy_weights(b, seed=3)
    init_dummy_weights(c, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    for name, p in a.named_parameters():
        assert torch.equal(sa[name], sb[name]), name
        assert not torch.equal(sa[name], sc[name]), name
        assert (p != 7.0).all(), f"{name} untouched"
        if "norm" in name:
            assert ((p - 1).abs() <= 1e-3).all(), name
        else:
            assert (p.abs() <= 1e-3).all(), name
    buffers = dict(a.named_buffers())
    assert all(torch.isfinite(v).all() for v in buffers.values())
