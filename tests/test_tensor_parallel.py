"""Tensor parallelism on CPU: ranks in worker processes, gloo on 127.0.0.1.

Two ranks must give what one gives, token for token (and prompt logprobs within 1e-4),
through chunked prefill, prefix-cache hits and preemption; seeded sampling the same. A
rank that dies is reported at once and leaves no process behind.
"""

from __future__ import annotations

import os
import signal

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.executor import WorkerError

PROMPTS = [list(range(200, 222)) + [7, 8, 9, 10, 11], list(range(200, 222)) + [12, 13, 14],
           [5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41]]


def _llm(path, tp, **kw):
    kw.setdefault("kv_cache_memory", 1 << 22)
    return LLM(path, skip_tokenizer_init=True, block_size=4, tensor_parallel_size=tp,
               num_threads=1, **kw)


def _run(llm, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], outs


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_two_ranks_equal_one_greedy_and_prompt_logprobs(tiny_models, arch):
    path = tiny_models[arch]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=2,
                            logprobs=2)
    one_tokens, one = _run(_llm(path, 1), params)
    llm = _llm(path, 2)
    two_tokens, two = _run(llm, params)
    assert two_tokens == one_tokens
    for a, b in zip(one, two):
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            for t in x:
                assert abs(x[t].logprob - y[t].logprob) < 1e-4
    stats = llm.stats()
    assert stats.num_blocks_free == stats.num_blocks_total
    llm.llm_engine.shutdown()


def test_the_cpu_decoder_runs_on_every_rank_and_changes_nothing(tiny_llama_dir):
    """Pure-decode steps go through the C++ decoder on each rank, which sums its partial
    o_proj / down_proj outputs through the shared-memory all-reduce between layers; tokens
    equal one rank's and the Python layers' on two ranks (enforce_eager)."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    one_tokens, one = _run(_llm(tiny_llama_dir, 1), params)
    outs = {}
    for eager in (False, True):
        llm = _llm(tiny_llama_dir, 2, enforce_eager=eager)
        paths = llm.llm_engine.core.model_executor._call("fast_paths")
        assert [p["cpu_decoder"] for p in paths] == [not eager, not eager]
        outs[eager] = _run(llm, params)
        # a prefill after decodes: the Python layers' all-reduce rounds continue the decoder's
        assert _run(llm, params)[0] == outs[eager][0]
        llm.llm_engine.shutdown()
    assert outs[False][0] == outs[True][0] == one_tokens
    for a, b in zip(outs[False][1], outs[True][1]):  # the same sums: the same logprobs
        assert [lp for lp in a.outputs[0].logprobs] == [lp for lp in b.outputs[0].logprobs]


def test_two_ranks_equal_one_with_a_float8_cache(tiny_llama_dir):
    """Each rank sees only its heads' K/V, but the scales take the largest over all ranks:
    two ranks quantise the cache exactly as one process does."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one_tokens, _ = _run(_llm(tiny_llama_dir, 1, kv_cache_dtype="fp8"), params)
    llm = _llm(tiny_llama_dir, 2, kv_cache_dtype="fp8")
    two_tokens, _ = _run(llm, params)
    assert two_tokens == one_tokens
    llm.llm_engine.shutdown()


def test_two_ranks_sampling_chunking_prefix_hits_and_preemption(tiny_llama_dir):
    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    small = dict(kv_cache_memory=26 * 2048, max_num_batched_tokens=9, max_model_len=64)
    expected, _ = _run(_llm(tiny_llama_dir, 1, **small), params)
    llm = _llm(tiny_llama_dir, 2, **small)
    got, _ = _run(llm, params)
    assert got == expected
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.num_blocks_free == stats.num_blocks_total
    llm.llm_engine.shutdown()


def test_one_rank_in_a_worker_process_equals_the_engine_process(tiny_llama_dir, capfd):
    """`mp` named with one rank runs that rank in a process of its own (the path a one-GPU
    machine takes through the executor); left unnamed, one rank stays in this process."""
    from pagedlm.executor import MultiprocExecutor, UniProcExecutor

    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, n=2)
    here = _llm(tiny_llama_dir, 1)
    assert isinstance(here.llm_engine.model_executor, UniProcExecutor)
    before = _children()
    apart = _llm(tiny_llama_dir, 1, distributed_executor_backend="mp")
    assert isinstance(apart.llm_engine.model_executor, MultiprocExecutor)
    assert len(_children() - before) == 1
    assert _run(apart, params)[0] == _run(here, params)[0]
    apart.llm_engine.shutdown()
    assert _children() <= before
    # The rank starts without runpy's warning of a module run twice (it was `python -m` of
    # a module that its own package imports).
    assert "RuntimeWarning" not in capfd.readouterr().err


def test_the_in_process_backend_takes_one_rank_only(tiny_llama_dir):
    with pytest.raises(ValueError, match="distributed_executor_backend='uni' .* "
                                         "tensor_parallel_size 1, got 2"):
        _llm(tiny_llama_dir, 2, distributed_executor_backend="uni")


def test_heads_that_do_not_divide_are_refused_at_start(tiny_llama_dir):
    before = _children()
    with pytest.raises(ValueError, match="num_attention_heads \\(4\\) is not divisible by the "
                                         "tensor-parallel size \\(3\\)"):
        _llm(tiny_llama_dir, 3)
    assert _children() <= before


def test_a_killed_rank_fails_the_step_fast_and_leaves_no_process(tiny_llama_dir):
    before = _children()
    llm = _llm(tiny_llama_dir, 2)
    engine = llm.llm_engine
    procs = engine.model_executor.procs
    engine.add_request("a", None, SamplingParams(max_tokens=200, ignore_eos=True),
                       prompt_token_ids=PROMPTS[0])
    engine.step()
    os.kill(procs[1].pid, signal.SIGKILL)
    procs[1].wait()
    # The very next step fails (the rank's closed socket wakes the engine's wait; no
    # timeout runs out first). How fast is a benchmark's business, not a test's.
    with pytest.raises(WorkerError, match="rank 1 .* died"):
        engine.step()
    assert all(p.poll() is not None for p in procs)
    with pytest.raises(WorkerError):
        engine.step()
    assert _children() <= before


# ----- every architecture ----------------------------------------------------------------

V = 101  # an odd vocabulary: the last rank's embedding / LM head shard is padded
_L = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
          initializer_range=0.08, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
          eos_token_id=2)
_NEOX = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.25,
             initializer_range=0.08, tie_word_embeddings=False)
_FALCON = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
               max_position_embeddings=256)
ARCHITECTURES = {
    "llama-biases": ("LlamaConfig", "LlamaForCausalLM", dict(_L, attention_bias=True, mlp_bias=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_L, head_dim=32)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_L, partial_rotary_factor=0.5)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(_L, head_dim=16, query_pre_attn_scalar=16, sliding_window=8)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(_L, head_dim=16, query_pre_attn_scalar=16, sliding_window=8)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_L, num_local_experts=4,
                                                           num_experts_per_tok=2)),
    "neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_NEOX, use_parallel_residual=True)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=V, hidden_size=96, n_head=12,
                                                      n_layer=2)),
    "mpt": ("MptConfig", "MptForCausalLM", dict(vocab_size=V, d_model=96, n_heads=12, n_layers=2,
                                                expansion_ratio=4, max_seq_len=256)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(vocab_size=V, n_embd=64, n_head=4, n_layer=2,
                                                   rotary_dim=8, n_positions=256)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=V, n_embd=64, n_head=4, n_layer=2,
                                                   n_positions=256)),
    "bigcode-mqa": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM",
                    dict(vocab_size=V, n_embd=64, n_head=4, n_layer=2, n_positions=256,
                         multi_query=True)),
    "opt-proj": ("OPTConfig", "OPTForCausalLM",
                 dict(vocab_size=V, hidden_size=64, num_attention_heads=4, ffn_dim=128,
                      num_hidden_layers=2, word_embed_proj_dim=32, max_position_embeddings=256,
                      pad_token_id=0)),
    "falcon-gqa": ("FalconConfig", "FalconForCausalLM",
                   dict(_FALCON, new_decoder_architecture=True, num_kv_heads=2, bias=True)),
    "falcon-mqa": ("FalconConfig", "FalconForCausalLM",
                   dict(_FALCON, multi_query=True, parallel_attn=True)),
    "falcon-alibi": ("FalconConfig", "FalconForCausalLM",
                     dict(_FALCON, alibi=True, multi_query=False, parallel_attn=False, bias=True)),
}


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory):
    import torch
    import transformers

    paths = {}
    for name, (config_cls, model_cls, kwargs) in ARCHITECTURES.items():
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).eval()
        with torch.no_grad():  # norms and biases away from 1 and 0, so sharding errors show
            for pname, p in model.named_parameters():
                if p.dim() == 1:
                    (p.normal_(0.0, 0.05) if pname.endswith("bias") else p.uniform_(0.5, 1.5))
        path = tmp_path_factory.mktemp(f"tp-{name}")
        model.save_pretrained(path, safe_serialization=True)
        paths[name] = str(path)
    return paths


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_architecture_two_ranks_equal_one(arch_dirs, arch):
    path = arch_dirs[arch]
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42], list(range(60, 90))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    runs = []
    for tp in (1, 2):
        llm = LLM(path, skip_tokenizer_init=True, block_size=4, kv_cache_memory=1 << 22,
                  tensor_parallel_size=tp, num_threads=1)
        runs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False))
        llm.llm_engine.shutdown()
    for one, two in zip(*runs):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids, arch
        for a, b in zip(one.outputs[0].logprobs, two.outputs[0].logprobs):
            for t in a:
                assert abs(a[t].logprob - b[t].logprob) < 1e-4, arch


def test_shapes_that_would_shard_wrongly_are_refused(monkeypatch):
    from pagedlm.layers import linear
    from pagedlm.layers.parallel_state import TensorParallelGroup

    monkeypatch.setattr(linear, "get_tp_group", lambda: TensorParallelGroup(0, 2))
    with pytest.raises(ValueError, match="output size \\(5\\) is not divisible"):
        linear.MergedColumnParallelLinear(8, [5, 5])  # 10 rows in all would divide
    with pytest.raises(ValueError, match="num_key_value_heads \\(3\\) and the tensor-parallel"):
        linear.QKVParallelLinear(64, 16, 6, 3)
    assert linear.QKVParallelLinear(64, 16, 4, 1).num_kv_heads == 1  # replicated


def test_q8_refuses_row_shards_not_aligned_to_quant_blocks(monkeypatch):
    from torch import nn

    from pagedlm.layers import linear, parallel_state, weight_format
    from pagedlm.layers.parallel_state import TensorParallelGroup

    group = TensorParallelGroup(0, 2)
    monkeypatch.setattr(linear, "get_tp_group", lambda: group)
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: group)
    monkeypatch.setattr(weight_format, "get_tp_group", lambda: group)
    model = nn.Sequential(linear.RowParallelLinear(96, 32))  # 48 per rank; 96 = 3 * 32
    with pytest.raises(ValueError, match="48 of its 96 input features per rank"):
        weight_format.apply_weight_format(model, "q8")
