"""The C++ decoder (models/llama_cpu_decode.py) against the model's own Python layers, its
reference: same tokens and the very same logprobs (it runs the same kernels in the same
order) over decode, prefill and mixed steps, KV blocks all returned, and the models and
steps it must not take.
Prefix caching is off: a second run would reuse the first one's prompt blocks, and a
prefill over cached blocks rounds differently from a whole one."""

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tests.conftest import requires_smollm2, smollm2_path

PROMPTS = [
    {"prompt_token_ids": [1, 5, 9, 200, 33, 7, 99, 4, 18, 77, 250, 3, 61, 2, 19, 400, 12]},
    {"prompt_token_ids": [3, 3, 48, 120]},
    {"prompt_token_ids": list(range(10, 51))},
    {"prompt_token_ids": [7]},
]


class Recording:
    """Stands in for the runner's decoder and records each step it ran: (decodes, prefills)."""

    def __init__(self, decoder) -> None:
        self.decoder, self.steps = decoder, []
        self.takes = decoder.takes

    def __call__(self, input_ids, positions, meta, *rest):
        self.steps.append((meta.num_decodes, meta.num_prefills))
        return self.decoder(input_ids, positions, meta, *rest)


def _generate(llm, fused: bool, prompts=PROMPTS):
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    runner._forward = runner._forward_cpu_decoder if fused else runner._forward_eager
    decoder = runner.cpu_decoder
    runner.cpu_decoder = recording = Recording(decoder)
    try:
        params = SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.cpu_decoder = decoder
    kv = llm.llm_engine.scheduler.kv
    kv.block_pool.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks
    return outs, recording.steps


def _check_same_as_layers(llm, prompts=PROMPTS, mixed=False):
    """`mixed`: some step has decodes next to prefill chunks (and the decoder ran it)."""
    assert llm.llm_engine.model_executor.driver_worker.model_runner.cpu_decoder is not None
    fused, steps = _generate(llm, fused=True, prompts=prompts)
    assert len(steps) >= 10
    assert any(p for _, p in steps)  # the prompts' steps too
    assert not mixed or any(d and p for d, p in steps)
    eager, none = _generate(llm, fused=False, prompts=prompts)
    assert none == []
    for a, b in zip(fused, eager):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: lp.logprob for t, lp in pa.items()} == {t: lp.logprob for t, lp in pb.items()}


@pytest.mark.parametrize("weight_dtype", ["q8", "auto"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_decoder_equals_the_python_layers(tiny_models, arch, weight_dtype):
    """Llama, Mistral and Qwen2 (QKV bias, one KV head, tied embeddings), with the int8
    kernel (q8) and with float32 panels (auto)."""
    llm = LLM(tiny_models[arch], skip_tokenizer_init=True, weight_dtype=weight_dtype, num_threads=2,
              enable_prefix_caching=False)
    _check_same_as_layers(llm)


def test_decoder_with_float16_weights(tiny_llama_dir):
    """float16 panels are covered; fbgemm's float16 GEMM (where torch has it) is not."""
    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, weight_dtype="float16", num_threads=2,
              enable_prefix_caching=False)
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    if runner.cpu_decoder is None:
        assert "Fp16WeightMatmul" in runner.enable_cpu_decoder()
    else:
        _check_same_as_layers(llm)


@requires_smollm2
def test_decoder_on_the_embedded_gguf_model():
    """SmolLM2's float32 weights are exact Q4_1 / Q8_0 blocks: up to 8 rows take the block
    kernel, more the float32 panels; 10 prompts cross that line as they finish."""
    llm = LLM(smollm2_path(), skip_tokenizer_init=True, num_threads=2, enable_prefix_caching=False)
    qkv = llm.llm_engine.model_executor.driver_worker.model.model.layers[0].self_attn.qkv_proj.weight_kernel
    assert type(qkv).__name__ == "QuantBlockMatmul" and qkv.max_rows < 10
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    assert runner.cpu_decoder is not None
    prompts = [{"prompt_token_ids": [1, 2 + i, 300 + 7 * i, 45]} for i in range(10)]
    params = [SamplingParams(max_tokens=3 + i, temperature=0, logprobs=2, ignore_eos=True)
              for i in range(10)]
    fused = llm.generate(prompts, params, use_tqdm=False)
    runner._forward = runner._forward_eager
    eager = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(fused, eager):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: lp.logprob for t, lp in pa.items()} == {t: lp.logprob for t, lp in pb.items()}


def test_decoder_reuses_and_grows_its_buffers(tiny_llama_dir):
    """The decoder keeps one set of activation buffers across steps: a batch that shrinks
    step by step (staggered lengths), then a larger batch than any before (the buffers
    grow), give the Python layers' logprobs every step; the hidden states it returns are
    not overwritten by the next step."""
    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, weight_dtype="q8", num_threads=2,
              enable_prefix_caching=False)
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    small = [{"prompt_token_ids": [5 + i, 9, 40 + i]} for i in range(2)]
    large = [{"prompt_token_ids": [1 + i, 30 + 2 * i, 7, 64 + i]} for i in range(7)]
    kept = []
    decoder = runner.cpu_decoder
    original = decoder.__call__

    class Keeping:  # holds on to each step's returned hidden states and a copy of them
        takes = decoder.takes

        def __call__(self, *args):
            out = original(*args)
            kept.append((out, out.clone()))
            return out

    for prompts in (small, large):
        params = [SamplingParams(max_tokens=2 + 2 * i, temperature=0, logprobs=2, ignore_eos=True)
                  for i in range(len(prompts))]
        runner.cpu_decoder, runner._forward = Keeping(), runner._forward_cpu_decoder
        fused = llm.generate(prompts, params, use_tqdm=False)
        runner.cpu_decoder, runner._forward = decoder, runner._forward_eager
        eager = llm.generate(prompts, params, use_tqdm=False)
        for a, b in zip(fused, eager):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert {t: lp.logprob for t, lp in pa.items()} == {t: lp.logprob for t, lp in pb.items()}
    assert len({out.shape[0] for out, _ in kept}) >= 5  # batches of many sizes, 1 to 7
    assert all(torch.equal(out, copy) for out, copy in kept)
    kv = llm.llm_engine.scheduler.kv
    kv.block_pool.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "fp8", "fp8_e5m2"])
def test_decoder_writes_each_cache_dtype_as_the_layers_do(tiny_llama_dir, kv_dtype):
    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, weight_dtype="q8", kv_cache_dtype=kv_dtype,
              num_threads=2, enable_prefix_caching=False)
    _check_same_as_layers(llm)


def test_decoder_with_a_sliding_window_and_mixed_steps(tmp_path):
    """A window shorter than the prompts, and chunked prefills of 16 tokens that share steps
    with decodes: the decoder runs those steps too."""
    from transformers import MistralConfig, MistralForCausalLM

    from tests.conftest import _save_tiny

    path = _save_tiny(tmp_path, MistralConfig, MistralForCausalLM, seed=3, sliding_window=8)
    llm = LLM(path, skip_tokenizer_init=True, weight_dtype="q8", num_threads=1,
              max_num_batched_tokens=16, enable_prefix_caching=False)
    _check_same_as_layers(llm, mixed=True)


def test_models_it_must_not_take(tiny_llama_dir, tiny_models):
    runner = LLM(tiny_llama_dir, skip_tokenizer_init=True, num_threads=1).llm_engine.model_executor.driver_worker.model_runner
    assert runner.cpu_decoder is not None
    mlp = runner.model.model.layers[1].mlp
    mlp.down_proj.weight_kernel = lambda x, bias: x @ torch.zeros(64, 128).T  # a matmul it cannot know
    assert "layer 1: down_proj multiplies with function" in runner.enable_cpu_decoder()
    assert runner.cpu_decoder is None and runner._forward == runner._forward_eager
    eager = LLM(tiny_llama_dir, skip_tokenizer_init=True, weight_dtype="q8", enforce_eager=True,
                num_threads=1).llm_engine.model_executor.driver_worker.model_runner
    assert eager.cpu_decoder is None and eager._forward == eager._forward_eager
    torch_backend = LLM(tiny_llama_dir, skip_tokenizer_init=True, weight_dtype="q8",
                        attention_backend="torch", num_threads=1).llm_engine.model_executor.driver_worker.model_runner
    assert torch_backend.cpu_decoder is None
    assert "not the CPU kernels" in torch_backend.enable_cpu_decoder()


def test_which_steps_the_decoder_takes(tiny_llama_dir):
    """Every pure-decode step, however large; steps with prompt chunks up to MAX_STEP_TOKENS
    tokens, and none where the prefill kernel does not take the head size."""
    from types import SimpleNamespace

    from pagedlm.models.llama_cpu_decode import MAX_STEP_TOKENS

    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, weight_dtype="q8", num_threads=1)
    decoder = llm.llm_engine.model_executor.driver_worker.model_runner.cpu_decoder
    assert decoder.takes_prefills

    def step(num_prefills, num_tokens):
        return SimpleNamespace(num_prefills=num_prefills, num_tokens=num_tokens)

    assert decoder.takes(step(0, 4 * MAX_STEP_TOKENS))
    assert decoder.takes(step(1, MAX_STEP_TOKENS))
    assert not decoder.takes(step(1, MAX_STEP_TOKENS + 1))
    decoder.takes_prefills = False
    assert decoder.takes(step(0, 8)) and not decoder.takes(step(1, 8))


def test_bad_slots_are_refused(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, weight_dtype="q8", num_threads=1)
    decoder = llm.llm_engine.model_executor.driver_worker.model_runner.cpu_decoder.decoder
    x, table = torch.zeros(1, 64), torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        decoder.forward(x, torch.tensor([0]), torch.tensor([10**9]), table, [1], 1, [])
    with pytest.raises(RuntimeError, match="one position and slot per token"):
        decoder.forward(x, torch.tensor([0, 1]), torch.tensor([0]), table, [1], 1, [])
    with pytest.raises(RuntimeError, match="one seq_len per token in a pure-decode step"):
        decoder.forward(x, torch.tensor([0]), torch.tensor([0]), table, [1], 0, [])
    x3, pos3, slots3 = torch.zeros(3, 64), torch.tensor([4, 0, 1]), torch.tensor([4, 8, 9])
    tables = torch.zeros(2, 4, dtype=torch.long)
    for num_decodes, starts in ((1, [0, 1]), (1, [0, 1, 4]), (2, [0, 1, 3])):
        with pytest.raises(RuntimeError, match="query_start must hold num_seqs"):
            decoder.forward(x3, pos3, slots3, tables, [5, 2], num_decodes, starts)
    with pytest.raises(RuntimeError, match="do not fit its block table"):
        decoder.forward(x3, pos3, slots3, tables, [5, 2**20], 1, [0, 1, 3])


def test_profile_times_each_part_of_the_decode_steps(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, weight_dtype="q8", num_threads=1)
    decoder = llm.llm_engine.model_executor.driver_worker.model_runner.cpu_decoder.decoder
    decoder.set_profile(True)
    assert all(t == 0.0 for _, t in decoder.profile())
    llm.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    parts = dict(decoder.profile())
    assert set(parts) == {"rms_norm", "qkv_proj", "rotary+cache_write", "attention", "o_proj",
                          "gate_up_proj", "silu_and_mul", "down_proj"}
    assert all(t > 0 for t in parts.values())
    decoder.set_profile(False)
    assert all(t == 0.0 for _, t in decoder.profile())
