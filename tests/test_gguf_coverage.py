"""GGUF coverage: every llama.cpp architecture and common quantisation the README's table lists.

Tiny HF models are written to GGUF here the way llama.cpp's convert_hf_to_gguf.py writes them:
tensor names from gguf's TensorNameMap (the converter's own table), values changed as the
converter changes them (llama's Q/K row permutation, Gemma's 1 + w norms, GPT-2's transposed
Conv1D weights and duplicated output matrix, Falcon's regrouped QKV rows, Phi-3's longrope
factor tensors), the metadata keys each converter writes, and a byte-level BPE vocabulary.
Then, through pagedlm's own loader and engine:
* every architecture, F16 weights: greedy tokens and prompt logprobs equal HF transformers' on
  the same (f16-rounded) weights;
* every quantisation: the tensors pagedlm reads equal gguf.quants.dequantize of the stored
  blocks, and greedy tokens equal HF's on those weights;
* an unsupported architecture or tensor type is one clear error line.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from pagedlm import LLM, SamplingParams
from pagedlm.loader.gguf_architectures import GGUF_ARCHITECTURES
from pagedlm.loader.gguf_loader import GGUFCheckpoint
from tests.helpers import (
    TINY_TOKENS,
    check_greedy_match,
    hf_greedy,
    hf_logprobs_along,
    write_tiny_tokenizer,
)

transformers = pytest.importorskip("transformers")

VOCAB = len(TINY_TOKENS)  # 260
PROMPTS = [[256, 17, 200, 42, 7], [5, 99, 99, 120, 4, 8, 15, 16, 23, 42, 250, 3, 9, 77]]
MAX_TOKENS = 8
_LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              initializer_range=0.08, bos_token_id=256, eos_token_id=256, pad_token_id=0)
_GPT2 = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, initializer_range=0.08,
             bos_token_id=256, eos_token_id=256)
_FALCON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               initializer_range=0.08, bias=False, parallel_attn=True)
_GEMMA = dict(_LLAMA, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
              attn_implementation="eager")
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
             "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]}

# case -> (llama.cpp architecture, transformers model class, config class, config kwargs)
CASES = {
    "llama": ("llama", "LlamaForCausalLM", "LlamaConfig", _LLAMA),
    # llama.cpp writes Mistral as "llama" (and records no sliding window)
    "mistral": ("llama", "MistralForCausalLM", "MistralConfig", dict(_LLAMA, sliding_window=None)),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", "Qwen2Config", dict(_LLAMA, num_key_value_heads=1,
                                                               tie_word_embeddings=True)),
    # head_dim 32 != hidden / heads: only attention.key_length says so
    "qwen3": ("qwen3", "Qwen3ForCausalLM", "Qwen3Config", dict(_LLAMA, head_dim=32)),
    "phi3": ("phi3", "Phi3ForCausalLM", "Phi3Config", dict(_LLAMA, partial_rotary_factor=0.5)),
    # max_position_embeddings == original: HF uses the short factors at every length here
    "phi3-longrope": ("phi3", "Phi3ForCausalLM", "Phi3Config",
                      dict(_LLAMA, max_position_embeddings=64, original_max_position_embeddings=64,
                           rope_parameters=_LONGROPE)),
    "gemma2": ("gemma2", "Gemma2ForCausalLM", "Gemma2Config",
               dict(_GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    # six layers: five sliding, one global with linearly scaled RoPE
    "gemma3": ("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig",
               dict(_GEMMA, num_hidden_layers=6, rope_parameters={
                   "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
    "gpt2": ("gpt2", "GPT2LMHeadModel", "GPT2Config", _GPT2),
    "starcoder": ("starcoder", "GPTBigCodeForCausalLM", "GPTBigCodeConfig", dict(_GPT2, multi_query=True)),
    "falcon-7b": ("falcon", "FalconForCausalLM", "FalconConfig",  # multi-query, one norm
                  dict(_FALCON, multi_query=True, new_decoder_architecture=False)),
    "falcon-40b": ("falcon", "FalconForCausalLM", "FalconConfig",  # grouped KV, two norms
                   dict(_FALCON, new_decoder_architecture=True, num_kv_heads=2)),
}


# ---------------------------------------------------------------------------------------------
# A small convert_hf_to_gguf.py
# ---------------------------------------------------------------------------------------------


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """LlamaModel.permute: per head, rows [x_0..x_{D/2-1} | y_0..] become [x_0, y_0, x_1, ...]."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _converted_tensors(arch: str, c, state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor as the converter stores it) in checkpoint order, extra tensors last."""
    out = []
    for name, t in state.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = _permute(t, c.num_attention_heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = _permute(t, c.num_key_value_heads)
        elif arch.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1
        elif arch == "gpt2" and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            t = t.t()
        elif arch == "falcon" and "query_key_value" in name:
            n_head, n_kv = c.num_attention_heads, (c.num_kv_heads if c.new_decoder_architecture else 1)
            d = c.hidden_size // n_head
            qkv = t.view(n_kv, n_head // n_kv + 2, d, d * n_head)
            t = torch.cat((qkv[:, :-2].reshape(-1, d * n_head), qkv[:, [-2]].reshape(-1, d * n_head),
                           qkv[:, [-1]].reshape(-1, d * n_head))).reshape_as(t)
        out.append((name, t))
        if arch == "gpt2" and name == "transformer.wte.weight":
            out.append(("lm_head.weight", t))  # "GPT2 output is tied to (same as) wte"
    if arch == "phi3" and c.rope_parameters["rope_type"] == "longrope":
        out.append(("rope_factors_long.weight", torch.tensor(c.rope_parameters["long_factor"])))
        out.append(("rope_factors_short.weight", torch.tensor(c.rope_parameters["short_factor"])))
    return out


def _write_metadata(w: gguf.GGUFWriter, arch: str, c) -> None:
    """Each converter's set_gguf_parameters, for the keys the tiny configs exercise."""
    if arch in ("gpt2", "starcoder"):
        w.add_context_length(c.n_positions)
        w.add_embedding_length(c.n_embd)
        w.add_feed_forward_length(4 * c.n_embd)
        w.add_block_count(c.n_layer)
        w.add_head_count(c.n_head)
        if arch == "starcoder":
            w.add_head_count_kv(1)
        w.add_layer_norm_eps(c.layer_norm_epsilon)
    elif arch == "falcon":
        w.add_context_length(2048)  # "not in config.json"
        w.add_tensor_data_layout("jploski")
        w.add_embedding_length(c.hidden_size)
        w.add_feed_forward_length(4 * c.hidden_size)
        w.add_block_count(c.num_hidden_layers)
        w.add_head_count(c.num_attention_heads)
        w.add_head_count_kv(c.num_kv_heads if c.new_decoder_architecture else 1)
        w.add_layer_norm_eps(c.layer_norm_epsilon)
    else:
        w.add_context_length(c.max_position_embeddings)
        w.add_embedding_length(c.hidden_size)
        w.add_block_count(c.num_hidden_layers)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_head_count(c.num_attention_heads)
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = getattr(c, "rope_parameters", None) or {}
    if arch in ("llama", "qwen2", "qwen3"):
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        if arch == "llama":
            w.add_vocab_size(c.vocab_size)
            w.add_rope_dimension_count(head_dim)
    elif arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * c.hidden_size) // c.num_attention_heads)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(c.sliding_window or 0)
        if rope["rope_type"] == "longrope":
            w.add_rope_scaling_attn_factors(1.0)  # max_position_embeddings / original == 1
    elif arch.startswith("gemma"):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_sliding_window(c.sliding_window)
        if arch == "gemma2":
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        else:
            full = rope["full_attention"]
            w.add_rope_freq_base(full["rope_theta"])
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])


def convert(model: torch.nn.Module, arch: str, path: Path, qtype: QT = QT.F16,
            blocks: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Write `model` as llama.cpp would: 2-D weights as `qtype` (or the given raw `blocks`),
    1-D tensors as F32. Returns the GGUF name -> stored raw bytes of every 2-D weight."""
    c = model.config
    # What the checkpoint file holds: tied LM heads are not saved.
    state = {k: v.detach() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and c.tie_word_embeddings)}
    tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny {arch}")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _write_metadata(w, arch, c)
    write_tiny_tokenizer(w)
    stored = {}
    for hf_name, t in _converted_tensors(arch, c, state):
        name = hf_name if hf_name.startswith("rope_factors") else \
            tensor_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        a = t.float().contiguous().numpy()
        if a.ndim == 1:
            w.add_tensor(name, a)
            continue
        if blocks is not None:
            raw = blocks[name]
        elif qtype == QT.F16:
            raw = a.astype(np.float16).view(np.uint8)
        else:
            raw = gguf.quants.quantize(a, qtype)
        stored[name] = raw
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _tiny_model(case: str, seed: int = 0) -> torch.nn.Module:
    arch, model_cls, config_cls, kwargs = CASES[case]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).eval()
    with torch.no_grad():  # HF inits norms to 1 (Gemma: 0) and biases to 0: make them count
        for name, p in model.named_parameters():
            if ("norm" in name or ".ln_" in name) and name.endswith("weight"):
                p.uniform_(*((-0.5, 0.5) if arch.startswith("gemma") else (0.5, 1.5)))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
            p.copy_(p.half().float())  # what an F16 file holds
    return model


def _llm(path: Path) -> LLM:
    return LLM(str(path), block_size=4, kv_cache_memory=1 << 22)


def _check_matches_hf(llm: LLM, hf: torch.nn.Module, context: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        ref = hf_greedy(hf, prompt, MAX_TOKENS)
        check_greedy_match(out.outputs[0].token_ids, ref, hf_logprobs_along(hf, prompt, ref),
                           len(prompt), context=context)
    prompt = PROMPTS[1]
    lp_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate({"prompt_token_ids": prompt}, lp_params, use_tqdm=False)[0]
    ref_lp = hf_logprobs_along(hf, prompt, [])
    for pos in range(1, len(prompt)):
        got = out.prompt_logprobs[pos][prompt[pos]].logprob
        assert got == pytest.approx(float(ref_lp[pos - 1, prompt[pos]]), abs=1e-4), (context, pos)


# ---------------------------------------------------------------------------------------------
# Architectures
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_architecture_f16_matches_hf(case: str, tmp_path: Path) -> None:
    arch, model_cls, _, _ = CASES[case]
    hf = _tiny_model(case, seed=len(case))
    convert(hf, arch, tmp_path / f"{case}.gguf")
    llm = _llm(tmp_path / f"{case}.gguf")
    config = llm.llm_engine.hf_config
    # Mistral's file is a "llama" file; everything else comes back as the class it left as.
    assert config.architectures == ["LlamaForCausalLM" if case == "mistral" else model_cls]
    if case == "gemma3":
        assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    tokenizer = llm.get_tokenizer()
    assert tokenizer.decode(tokenizer("hello world").input_ids) == "hello world"
    _check_matches_hf(llm, hf, case)


def test_falcon_norm_names_follow_llama_cpp(tmp_path: Path) -> None:
    """Falcon-40B's ln_attn is llama.cpp's attn_norm_2 and ln_mlp its attn_norm, not the
    other way round (llama.cpp runs the attention on attn_norm_2 when it exists)."""
    hf = _tiny_model("falcon-40b")
    convert(hf, "falcon", tmp_path / "f.gguf")
    with GGUFCheckpoint(tmp_path / "f.gguf") as ckpt:
        assert ckpt.hf_name("blk.1.attn_norm_2.weight") == "transformer.h.1.ln_attn.weight"
        assert ckpt.hf_name("blk.1.attn_norm.bias") == "transformer.h.1.ln_mlp.bias"
        got = dict(ckpt.weights())
    state = hf.state_dict()
    assert set(got) == set(state) - {"lm_head.weight"}  # tied
    for name, tensor in got.items():
        assert torch.equal(tensor, state[name]), name


def test_gpt2_duplicated_output_is_tied(tmp_path: Path) -> None:
    convert(_tiny_model("gpt2"), "gpt2", tmp_path / "g.gguf")
    with GGUFCheckpoint(tmp_path / "g.gguf") as ckpt:
        assert "output.weight" in ckpt.tensor_infos
        assert ckpt.config.tie_word_embeddings is True
        assert "lm_head.weight" not in dict(ckpt.weights())


# ---------------------------------------------------------------------------------------------
# Quantisations
# ---------------------------------------------------------------------------------------------

QUANT_TYPES = [QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0,
               QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]
# gguf's quants module dequantises these but cannot quantise to them: random valid blocks,
# their fp16 scale fields (byte offsets in a block) set to finite values.
_K_SCALE_FIELDS = {QT.Q2_K: [80, 82], QT.Q3_K: [108], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208]}
# Every row a whole number of 256-value super-blocks.
_QUANT_CONFIG = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     initializer_range=0.05, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def quant_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_QUANT_CONFIG)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _random_blocks(qtype: QT, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random blocks whose dequantised values have a standard deviation of about 0.05."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(shape[0], shape[1] // block_size, type_size), dtype=np.uint8)
    fields = _K_SCALE_FIELDS[qtype]
    for start in fields:
        raw[..., start : start + 2] = np.float16(1.0).reshape(1).view(np.uint8)
    scale = 0.05 / gguf.quants.dequantize(raw.reshape(shape[0], -1), qtype).std()
    for start in fields:
        values = (rng.uniform(0.5, 1.5, raw.shape[:2]) * scale).astype(np.float16)
        raw[..., start : start + 2] = values[..., None].view(np.uint8)
    return raw.reshape(shape[0], -1)


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_quantisation_loads_as_reference(qtype: QT, quant_model: torch.nn.Module, tmp_path: Path) -> None:
    blocks = None
    if qtype in _K_SCALE_FIELDS:
        rng = np.random.default_rng(int(qtype))
        tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        blocks = {tensor_map.get_name(n, try_suffixes=(".weight",)): _random_blocks(qtype, tuple(p.shape), rng)
                  for n, p in quant_model.state_dict().items() if p.dim() == 2}
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    stored = convert(quant_model, "llama", path, qtype, blocks)
    c = quant_model.config
    reference = {}
    with GGUFCheckpoint(path) as ckpt:
        for name, raw in stored.items():
            assert ckpt.tensor_infos[name].ggml_type == qtype, name
            reference[ckpt.hf_name(name)] = torch.from_numpy(
                gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(ckpt.tensor_infos[name].shape))
        got = dict(ckpt.weights())
    assert set(got) == set(quant_model.state_dict())
    for name, tensor in got.items():
        if name in reference:  # the converter's permutation, undone by the test's own inverse
            expected = reference[name]
            if ".q_proj." in name:
                expected = _unpermute(expected, c.num_attention_heads)
            elif ".k_proj." in name:
                expected = _unpermute(expected, c.num_key_value_heads)
            assert torch.equal(tensor, expected), name
            reference[name] = expected
        else:
            assert torch.equal(tensor, quant_model.state_dict()[name]), name  # F32 norms
    # The engine on the file against HF's Llama holding the reference dequantisation.
    hf = transformers.LlamaForCausalLM(c).eval()
    hf.load_state_dict({**quant_model.state_dict(), **reference})
    _check_matches_hf(_llm(path), hf, qtype.name)


# ---------------------------------------------------------------------------------------------
# What does not load: one clear line
# ---------------------------------------------------------------------------------------------

# pagedlm runs these as HF models and llama.cpp writes them, but their GGUF files do not load
# (README, "GGUF files"); Mixtral is "llama" with experts.
UNSUPPORTED = ["gptneox", "bloom", "mpt", "baichuan", "qwen", "mixtral"]


def _write_minimal(path: Path, arch: str, tensors: dict[str, np.ndarray], **keys: int) -> None:
    """A header the loader stops at: the architecture, a few keys, the named tensors."""
    w = gguf.GGUFWriter(path, arch)
    for key, value in keys.items():
        w.add_uint32(f"{arch}.{key}", value)
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", UNSUPPORTED)
def test_unsupported_architecture_is_one_line(arch: str, tmp_path: Path) -> None:
    experts = {"expert_count": 8} if arch == "mixtral" else {}
    _write_minimal(tmp_path / "x.gguf", "llama" if arch == "mixtral" else arch,
                   {"output_norm.weight": np.ones(4, dtype=np.float32)}, **experts)
    with pytest.raises(ValueError) as info:
        LLM(str(tmp_path / "x.gguf"))
    message = str(info.value)
    assert "\n" not in message
    if arch == "mixtral":
        assert message.startswith("Mixture-of-experts 'llama' GGUF files are not supported")
    else:
        assert f"architecture {arch!r} is not supported; supported: " in message
        assert message.endswith(", ".join(sorted(GGUF_ARCHITECTURES)))


def test_unsupported_tensor_type_is_one_line(tmp_path: Path) -> None:
    # I8: a GGML type for integer data, never one for weights; nothing dequantises it.
    path = tmp_path / "x.gguf"
    _write_minimal(path, "llama", {"output_norm.weight": np.ones(32, dtype=np.float32),
                                   "blk.0.attn_v.weight": np.zeros((4, 32), dtype=np.int8)})
    with pytest.raises(ValueError) as info:
        LLM(str(path))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("GGUF tensor 'blk.0.attn_v.weight' is stored as I8, which pagedlm "
                              "cannot dequantise; use a file quantised to supported types: F32, F16, Q4_0, ")
    assert all(t.name in message for t in QUANT_TYPES)

    # A type id the gguf package does not know at all, patched into the same header.
    data = bytearray(path.read_bytes())
    at = data.index(b"blk.0.attn_v.weight") + len("blk.0.attn_v.weight")
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 99)
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=re.escape("GGUF tensor 'blk.0.attn_v.weight' has GGML type 99, ")):
        GGUFCheckpoint(path)


def test_readme_table_lists_what_loads() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme[readme.index("### GGUF files"):]
    section = section[: section.index("\n## ")]
    loads = set(re.findall(r"^\| `([\w-]+)` \| .* \| yes", section, flags=re.M))
    assert loads == set(GGUF_ARCHITECTURES)
    for case, (arch, *_rest) in CASES.items():
        assert arch in loads, case
    for arch in UNSUPPORTED:
        row = "`llama` with `expert_count`" if arch == "mixtral" else f"`{arch}`"
        assert re.search(rf"^\| {row} \| .* \| no \|", section, flags=re.M), arch
    for qtype in QUANT_TYPES:
        assert f"`{qtype.name}`" in section, qtype.name
