"""The element-wise layers' Triton kernels (layers/triton_layer_kernels.py) against the layers'
torch references: RMSNorm with and without the residual, SiLU-and-mul, rotary embedding in
both pair layouts, full and partial. On CPU under Triton's interpreter; with CUDA the same
tests compile and run the real kernels.

The kernels round where torch rounds, so in float32 they agree with the references to a
few ulp (the RMSNorm's sum in another order) and in bf16/float16 all but rarely bit for
bit (a float32 difference that crosses a rounding boundary moves one element by one ulp).
Triton's interpreter (Triton 3.x) converts float32 to bf16 by truncation where a GPU and
torch round to nearest (1.0078125 becomes 1.0), so bf16 runs on a GPU only; float16, which
the interpreter rounds as a GPU does, takes the same code paths on CPU.
"""

import pytest
import torch

from tests.helpers import use_triton_interpreter

use_triton_interpreter()  # before triton is imported
pytest.importorskip("triton")

from pagedlm.layers import triton_layer_kernels as tlk  # noqa: E402
from pagedlm.layers import triton_ops as triton_ops_module  # noqa: E402
from pagedlm.layers.activation import SiluAndMul  # noqa: E402
from pagedlm.layers.norm import RMSNorm  # noqa: E402
from pagedlm.layers.rotary import RotaryEmbedding  # noqa: E402
from pagedlm.layers.triton_ops import ENV, triton_ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.fixture(autouse=True)
def _kernels_take_cpu_tensors(monkeypatch):
    """Without CUDA the layers hand their CPU tensors to the interpreted kernels."""
    monkeypatch.setattr(triton_ops_module, "INTERPRETED_ON_CPU", DEVICE == "cpu")


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal but for float32 rounding: float32 to a few ulp; in bf16/float16 at most one
    element in 50 off by one ulp of the dtype."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        return
    o, r = out.float(), ref.float()
    ulp = torch.finfo(out.dtype).eps * r.abs().clamp_min(torch.finfo(out.dtype).tiny)
    off = (o - r).abs() > 0
    assert ((o - r).abs() <= 2 * ulp + 1e-30).all(), (o - r).abs().max()
    assert off.float().mean() <= 0.02, f"{int(off.sum())} of {off.numel()} elements differ"


def _reference_mode(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 96), (3, 40)])
def test_rms_norm_matches_the_reference(monkeypatch, dtype, with_residual, rows, hidden):
    g = torch.Generator().manual_seed(rows * hidden)
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    norm = norm.to(DEVICE)
    x = (3 * torch.randn(rows, hidden, generator=g)).to(dtype).to(DEVICE)
    res = torch.randn(rows, hidden, generator=g).to(dtype).to(DEVICE) if with_residual else None
    _reference_mode(monkeypatch)
    ref = norm(x.clone(), None if res is None else res.clone())
    monkeypatch.setenv(ENV, "1")
    assert triton_ops(x) is not None
    out = norm(x, res)
    if with_residual:
        _close(out[0], ref[0])
        assert torch.equal(out[1], ref[1])  # x + residual, rounded once either way
    else:
        _close(out, ref)


def test_rms_norm_of_a_3d_strided_input(monkeypatch):
    """A [batch, tokens, hidden] view whose rows are not adjacent (a slice of a wider
    tensor): the layer reshapes, the kernel reads by row stride."""
    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(32, eps=1e-6).to(DEVICE)
    wide = torch.randn(2, 3, 48, generator=g).to(DEVICE)
    x = wide[..., :32]
    _reference_mode(monkeypatch)
    ref = norm._norm(x)
    monkeypatch.setenv(ENV, "1")
    _close(norm(x), ref)


def test_rms_norm_output_dtype_follows_torch(monkeypatch):
    """A float32 weight over float16 activations gives float32, as weight * x does."""
    norm = RMSNorm(16).to(DEVICE)
    x = torch.randn(2, 16).to(torch.float16).to(DEVICE)
    _reference_mode(monkeypatch)
    ref = norm._norm(x)
    monkeypatch.setenv(ENV, "1")
    out = norm(x)
    assert out.dtype == ref.dtype == torch.float32
    _close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (4, 200), (2, 3, 48)])
def test_silu_and_mul_matches_the_reference(monkeypatch, dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (4 * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)
    layer = SiluAndMul()
    _reference_mode(monkeypatch)
    ref = layer(x)
    monkeypatch.setenv(ENV, "1")
    _close(layer(x), ref)


def test_silu_and_mul_splits_wide_rows_over_programs():
    """Rows wider than one program's block (1024) take several programs."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 2 * 1500, generator=g).to(DEVICE)
    gate, up = x.chunk(2, dim=-1)
    _close(tlk.silu_and_mul(x), torch.nn.functional.silu(gate) * up)


class _Config:
    rope_theta = 10000.0
    rope_parameters = None
    rope_scaling = None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("head_dim,rotary_dim", [(32, None), (40, 16), (24, 24)])
def test_rotary_matches_the_reference(monkeypatch, dtype, interleaved, head_dim, rotary_dim):
    g = torch.Generator().manual_seed(head_dim + (rotary_dim or 0))
    rope = RotaryEmbedding(_Config(), head_dim, 64, dtype, rotary_dim=rotary_dim,
                           interleaved=interleaved).to(DEVICE)
    tokens, heads, kv_heads = 5, 4, 2
    # q and k as views into one fused projection, as the attention layers split them
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(DEVICE)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 7, 3, 63, 20]).to(DEVICE)
    _reference_mode(monkeypatch)
    ref_q, ref_k = rope(positions, q, k)
    monkeypatch.setenv(ENV, "1")
    out_q, out_k = rope(positions, q, k)
    _close(out_q, ref_q)
    _close(out_k, ref_k)
    if rotary_dim is not None and rotary_dim < head_dim:  # the rest passes through untouched
        assert torch.equal(out_q[..., rotary_dim:], q[..., rotary_dim:])


def test_off_unless_asked(monkeypatch):
    x = torch.randn(2, 8).to(DEVICE)
    monkeypatch.delenv(ENV, raising=False)
    assert triton_ops(x) is None
    monkeypatch.setenv(ENV, "1")
    assert triton_ops(x) is not None
    assert triton_ops(x.to(torch.int32)) is None


def test_a_model_generates_the_same_tokens(monkeypatch, tmp_path):
    """A tiny random Llama, float16, greedy: the same tokens with the kernels as with the
    torch references (every RMSNorm, SiLU-and-mul and rotary call of the model runs them)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedlm import LLM, SamplingParams

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    prompts = [{"prompt_token_ids": [(5 * i + 3 * j) % 290 + 3 for j in range(3 + 4 * i)]}
               for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    calls = {"rms_norm": 0, "silu_and_mul": 0, "rotary": 0}
    for name in calls:
        def counted(*args, _name=name, _fn=getattr(tlk, name), **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(tlk, name, counted)
    for mode in ("reference", "triton"):
        if mode == "triton":
            monkeypatch.setenv(ENV, "1")
        else:
            monkeypatch.delenv(ENV, raising=False)
        llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float16", device=DEVICE,
                  enforce_eager=True, max_model_len=128, kv_cache_memory=1 << 22)
        tokens[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                     use_tqdm=False)]
        del llm
        if mode == "reference":
            assert not any(calls.values())
    assert tokens["triton"] == tokens["reference"]
    assert all(calls.values()), calls
