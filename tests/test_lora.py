"""LoRA adapters end to end: pagedlm's greedy tokens equal HF transformers + PEFT's
(`PeftModel.from_pretrained`, adapter not merged) on tiny random models of several
architectures, with adapters of every supported kind (rsLoRA, rank/alpha patterns,
some modules only, HF-fused and Conv1D projections); mixed batches of adapters and the
base model, slot eviction, chunked prefill, preemption, prefix-cache isolation, block
accounting, the errors a bad adapter gets, and two tensor-parallel ranks.

Adapters are made with `init_lora_weights=False` (random B), so each one changes the
model's output: every test also checks that it did.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagedlm import LLM, LoRARequest, SamplingParams
from tests.helpers import (
    assert_tokens_equal_or_near_tie,
    check_greedy_match,
    hf_greedy,
    hf_logprobs_along,
)

MAX_TOKENS = 12
MAX_RANK = 8
PROMPTS = [
    [1, 17, 300, 42, 7],
    [5, 99, 99, 99, 120, 4, 8, 15, 16, 23, 42, 250, 3],
    list(range(3, 23)),
]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

_LLAMA_LIKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   initializer_range=0.08, tie_word_embeddings=False)
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name: (config class, model class, config, LoRA target modules by their HF names, extra
# LoraConfig arguments)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _LLAMA_LIKE, LLAMA_TARGETS, {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _LLAMA_LIKE, LLAMA_TARGETS, {}),  # q/k/v biases
    "neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
             dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=256, initializer_range=0.08,
                  rotary_pct=0.25, tie_word_embeddings=False),
             ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"], {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=512, n_embd=64, n_head=4, n_layer=2, n_positions=256,
                  initializer_range=0.08, bos_token_id=1, eos_token_id=2),
             ["c_attn", "c_proj", "c_fc"], dict(fan_in_fan_out=True)),  # Conv1D
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(_LLAMA_LIKE, partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2),
             ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], {}),  # HF-fused
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(vocab_size=512, hidden_size=64, num_attention_heads=4, ffn_dim=128,
                 num_hidden_layers=2, max_position_embeddings=256, pad_token_id=0, init_std=0.08),
            ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"], {}),
    "falcon": ("FalconConfig", "FalconForCausalLM",
               dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                    new_decoder_architecture=True, num_kv_heads=2, bias=True,
                    max_position_embeddings=256, initializer_range=0.08),
               ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"], {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_LLAMA_LIKE, head_dim=32),  # q/k norms
              LLAMA_TARGETS, {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(_LLAMA_LIKE, head_dim=32, query_pre_attn_scalar=24, sliding_window=6,
                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                    pad_token_id=0, eos_token_id=1, bos_token_id=2, attn_implementation="eager"),
               LLAMA_TARGETS, {}),
    "bloom": ("BloomConfig", "BloomForCausalLM",  # fused query_key_value, ALiBi
              dict(vocab_size=512, hidden_size=64, n_layer=2, n_head=4, initializer_range=0.08),
              ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
              dict(lora_alpha=128)),  # at alpha 16 its greedy tokens do not change
    "mpt": ("MptConfig", "MptForCausalLM",  # fused Wqkv
            dict(vocab_size=512, d_model=64, n_heads=4, n_layers=2, max_seq_len=64,
                 initializer_range=0.08),
            ["Wqkv", "out_proj", "up_proj", "down_proj"], {}),
    "gptj": ("GPTJConfig", "GPTJForCausalLM",
             dict(vocab_size=512, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                  n_positions=256, initializer_range=0.08),
             ["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"], {}),
    "bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM",  # multi-query fused c_attn
                dict(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                     initializer_range=0.08, multi_query=True),
                ["c_attn", "c_proj", "c_fc"], {}),
}

# The Llama adapters (the other architectures get one "full" adapter each).
LLAMA_ADAPTERS = {
    "full": dict(r=8, lora_alpha=16, target_modules=LLAMA_TARGETS),
    "rslora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=LLAMA_TARGETS),
    # Per-module ranks and alphas, by module name and by a full layer path.
    "pattern": dict(r=4, lora_alpha=8, target_modules=LLAMA_TARGETS,
                    rank_pattern={"q_proj": 8, "model.layers.1.mlp.down_proj": 2},
                    alpha_pattern={"v_proj": 32, "layers.0.mlp.gate_proj": 3}),
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),  # some modules only
}


def _transformers_cls(name):
    import transformers

    return getattr(transformers, name)


class Zoo:
    """Tiny checkpoints, their adapters and HF + PEFT references, built on first use."""

    def __init__(self, root) -> None:
        self.root = root
        self.paths: dict[str, str] = {}
        self.adapters: dict[tuple[str, str], str] = {}
        self._hf: dict[tuple[str, str | None], object] = {}
        self._refs: dict[tuple[str, str | None, tuple[int, ...]], list[int]] = {}

    def adapter_names(self, arch: str) -> list[str]:
        return list(LLAMA_ADAPTERS) if arch == "llama" else ["full"]

    def path(self, arch: str) -> str:
        if arch not in self.paths:
            config_cls, model_cls, kwargs, _, _ = ARCHS[arch]
            torch.manual_seed(0)
            model = _transformers_cls(model_cls)(_transformers_cls(config_cls)(**kwargs)).eval()
            path = self.root / arch
            model.save_pretrained(path, safe_serialization=True)
            self.paths[arch] = str(path)
            for i, name in enumerate(self.adapter_names(arch)):
                lora = LLAMA_ADAPTERS[name] if arch == "llama" else {
                    **dict(r=8, lora_alpha=16, target_modules=ARCHS[arch][3]), **ARCHS[arch][4]}
                self.adapters[arch, name] = self.make_adapter(arch, f"{arch}-{name}", seed=10 + i,
                                                              **lora)
        return self.paths[arch]

    def make_adapter(self, arch: str, dirname: str, seed: int, save: dict | None = None,
                     **lora) -> str:
        from peft import LoraConfig, get_peft_model

        base = _transformers_cls(ARCHS[arch][1]).from_pretrained(self.path(arch))
        torch.manual_seed(seed)
        peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora))
        path = self.root / dirname
        peft_model.save_pretrained(path, **(save or {}))
        return str(path)

    def request(self, arch: str, name: str | None) -> LoRARequest | None:
        if name is None:
            return None
        self.path(arch)
        names = self.adapter_names(arch)
        return LoRARequest(f"{arch}-{name}", 1 + names.index(name), self.adapters[arch, name])

    def hf(self, arch: str, adapter: str | None):
        key = (arch, adapter)
        if key not in self._hf:
            from peft import PeftModel

            base = _transformers_cls(ARCHS[arch][1]).from_pretrained(self.path(arch),
                                                                     dtype=torch.float32)
            model = base if adapter is None else PeftModel.from_pretrained(
                base, self.adapters[arch, adapter])
            self._hf[key] = model.eval()
        return self._hf[key]

    def ref(self, arch: str, adapter: str | None, prompt: list[int]) -> list[int]:
        key = (arch, adapter, tuple(prompt))
        if key not in self._refs:
            self._refs[key] = hf_greedy(self.hf(arch, adapter), prompt, MAX_TOKENS)
        return self._refs[key]

    def check(self, ours: list[int], arch: str, adapter: str | None, prompt: list[int],
              context: str = "") -> None:
        """Our greedy tokens equal HF + PEFT's (or part at a proven near-tie)."""
        ref = self.ref(arch, adapter, prompt)
        assert len(ours) == MAX_TOKENS
        if ours != ref:
            check_greedy_match(ours, ref, hf_logprobs_along(self.hf(arch, adapter), prompt, ref),
                               len(prompt), context=f"{arch}/{adapter} {context}")


@pytest.fixture(scope="module", autouse=True)
def restore_threads():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Zoo:
    return Zoo(tmp_path_factory.mktemp("lora"))


def make_llm(path: str, **kw) -> LLM:
    kw.setdefault("enable_lora", True)
    if kw["enable_lora"]:
        kw.setdefault("max_lora_rank", MAX_RANK)
    # One thread: these models are tiny, and a second thread only adds wake-ups.
    return LLM(path, skip_tokenizer_init=True, block_size=4, kv_cache_memory=1 << 22,
               num_threads=1, **kw)


def generate(llm: LLM, rows, params=GREEDY, zoo: Zoo | None = None, arch: str = "llama"):
    """rows: [(prompt, adapter name or None)]; the token ids of each row, blocks checked."""
    loras = [None if a is None else zoo.request(arch, a) for _, a in rows]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in rows], params, use_tqdm=False,
                        lora_request=loras)
    assert_all_blocks_back(llm)
    return [o.outputs[0].token_ids for o in outs], outs


def assert_all_blocks_back(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    stats = llm.stats()
    assert stats.num_blocks_free == stats.num_blocks_total, "KV blocks leaked"
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    engine.scheduler.check_invariants()


def assert_same_greedy(a: list[int], b: list[int], out_a, context: str) -> None:
    assert_tokens_equal_or_near_tie(a, b, out_a.outputs[0].logprobs, context)


@pytest.fixture(scope="module")
def llama_llm(zoo):
    """Shared: three slots for the four Llama adapters (so a batch of all of them evicts)."""
    llm = make_llm(zoo.path("llama"), max_loras=3)
    yield llm
    llm.llm_engine.shutdown()


# ----- equality with HF + PEFT -----------------------------------------------------------------

@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_matches_hf_peft(zoo, arch, request):
    """All of an architecture's adapters and the base model in one batch."""
    if arch == "llama":
        llm = request.getfixturevalue("llama_llm")
    else:
        llm = make_llm(zoo.path(arch), max_loras=2)
    adapters = [*zoo.adapter_names(arch), None]
    rows = [(p, a) for a in adapters for p in PROMPTS]
    got, _ = generate(llm, rows, zoo=zoo, arch=arch)
    ours = {}
    for (prompt, adapter), tokens in zip(rows, got):
        zoo.check(tokens, arch, adapter, prompt, context="batched")
        ours[adapter, tuple(prompt)] = tokens
    for adapter in adapters[:-1]:  # each adapter changes the output, or this proves nothing
        assert any(ours[adapter, tuple(p)] != ours[None, tuple(p)] for p in PROMPTS), adapter
        assert any(zoo.ref(arch, adapter, p) != zoo.ref(arch, None, p) for p in PROMPTS)
    if arch != "llama":
        llm.llm_engine.shutdown()


def test_adapters_differ_from_each_other(zoo):
    """The Llama adapters are not accidentally one adapter loaded four times."""
    outs = {a: tuple(tuple(zoo.ref("llama", a, p)) for p in PROMPTS) for a in LLAMA_ADAPTERS}
    assert len(set(outs.values())) == len(LLAMA_ADAPTERS)


def test_prompt_logprobs_match_hf_peft(zoo, llama_llm):
    """Logprobs at every prompt position under an adapter: the whole forward, not only the
    argmax, equals PEFT's."""
    prompt = PROMPTS[2]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)
    for adapter in ("pattern", "qv"):
        out = llama_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False,
                                 lora_request=zoo.request("llama", adapter))[0]
        ref = hf_logprobs_along(zoo.hf("llama", adapter), prompt, [])
        base = hf_logprobs_along(zoo.hf("llama", None), prompt, [])
        for pos in range(1, len(prompt)):
            got = out.prompt_logprobs[pos][prompt[pos]].logprob
            assert got == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4), (adapter, pos)
        assert (ref - base).abs().max() > 1e-2  # the adapter moves the logprobs
    assert_all_blocks_back(llama_llm)


def test_n_samples_fork_with_their_adapter(zoo, llama_llm):
    """n = 2: the second sample is forked from the first after the prompt and must run
    under the same adapter (its own row in the batch)."""
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = PROMPTS[1]
    outs = llama_llm.generate([{"prompt_token_ids": prompt}] * 2, params, use_tqdm=False,
                              lora_request=[zoo.request("llama", "full"), None])
    for out, adapter in zip(outs, ("full", None)):
        assert len(out.outputs) == 2
        for sample in out.outputs:
            zoo.check(sample.token_ids, "llama", adapter, prompt, context="n=2")
    assert_all_blocks_back(llama_llm)


def test_beam_search_runs_under_the_adapter_or_is_refused(zoo, llama_llm):
    """SamplingParams(use_beam_search=True) with a lora_request: the search must use the
    adapter (one beam: its greedy tokens) or be refused, never run on the base model."""
    params = SamplingParams(n=1, use_beam_search=True, temperature=0, max_tokens=MAX_TOKENS,
                            ignore_eos=True)
    prompt = PROMPTS[1]
    base = llama_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    zoo.check(base.outputs[0].token_ids, "llama", None, prompt, context="beam width 1, base")
    try:
        out = llama_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False,
                                 lora_request=zoo.request("llama", "full"))[0]
    except ValueError as e:
        assert "lora" in str(e).lower() or "adapter" in str(e).lower(), e
    else:
        assert out.outputs[0].token_ids != base.outputs[0].token_ids, (
            "beam search with a lora_request ran on the base model")
        zoo.check(out.outputs[0].token_ids, "llama", "full", prompt, context="beam width 1")
    assert_all_blocks_back(llama_llm)


@pytest.mark.parametrize("spelling", ["trailing-slash", "dot-segment"])
def test_the_same_request_works_again_whatever_its_path_spelling(zoo, llama_llm, spelling):
    """Reusing one LoRARequest (one object for many generate calls, as vLLM users do)
    must work whatever the spelling of its directory: `dir/` and `parent/./dir` name the
    same adapter on the second call as on the first."""
    zoo.path("llama")
    adapter_dir = zoo.adapters["llama", "rslora"]
    head, tail = adapter_dir.rsplit("/", 1)
    path = adapter_dir + "/" if spelling == "trailing-slash" else f"{head}/./{tail}"
    lora = LoRARequest(spelling, 31 if spelling == "trailing-slash" else 32, path)
    for attempt in range(2):
        out = llama_llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                                 lora_request=lora)[0]
        zoo.check(out.outputs[0].token_ids, "llama", "rslora", PROMPTS[0],
                  context=f"{spelling} call {attempt + 1}")
    assert_all_blocks_back(llama_llm)


def test_two_names_for_one_adapter_share_a_slot(zoo):
    """The same directory under two names is one adapter's content: one slot, shared
    prefix-cache blocks, both names running together even with one slot."""
    llm = make_llm(zoo.path("llama"), max_loras=1)
    alias = LoRARequest("alias", 41, zoo.adapters["llama", "full"])
    prompt = list(range(300, 318))
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, GREEDY, use_tqdm=False,
                        lora_request=[zoo.request("llama", "full"), alias])
    assert llm.llm_engine.scheduler.lora_slots.num_loads == 1
    for out in outs:
        zoo.check(out.outputs[0].token_ids, "llama", "full", prompt, context="alias")
    before = llm.stats().prefix_cache_hits
    again = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                         lora_request=alias)[0]
    assert llm.stats().prefix_cache_hits - before == (len(prompt) - 1) // 4 * 4
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert_all_blocks_back(llm)
    llm.llm_engine.shutdown()


def test_chunked_prefill(zoo):
    """A 7-token budget: prompts in chunks, next to other requests' decodes."""
    llm = make_llm(zoo.path("llama"), max_loras=2, max_num_batched_tokens=7)
    rows = [(p, a) for a in ("full", "pattern", None) for p in PROMPTS]
    got, _ = generate(llm, rows, zoo=zoo)
    for (prompt, adapter), tokens in zip(rows, got):
        zoo.check(tokens, "llama", adapter, prompt, context="chunked prefill")
    llm.llm_engine.shutdown()


# ----- mixed batches: each row as if alone ----------------------------------------------------

MIXED = [(PROMPTS[0], "full"), (PROMPTS[1], "rslora"), (PROMPTS[2], None),
         (PROMPTS[1], "qv"), (PROMPTS[0], None), (PROMPTS[2], "full"), (PROMPTS[0], "qv")]
LOGPROBS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("max_loras", [1, 3])
def test_mixed_batch_equals_each_row_alone(zoo, llama_llm, max_loras):
    """Three adapters and the base model interleaved in one batch. With one slot the
    adapters take turns (the others wait while one runs; the base rows are admitted past
    them); with three all run together."""
    if max_loras == 3:
        llm = llama_llm
    else:
        # Also the Python layers for every step (the shared engine's decodes may go
        # through the C++ decoder).
        llm = make_llm(zoo.path("llama"), max_loras=1, enable_prefix_caching=False,
                       enforce_eager=True)
    batched, outs = generate(llm, MIXED, LOGPROBS, zoo=zoo)
    alone = [generate(llm, [row], LOGPROBS, zoo=zoo)[0][0] for row in MIXED]
    for (prompt, adapter), b, a, out in zip(MIXED, batched, alone, outs):
        assert_same_greedy(b, a, out, f"{adapter} batched vs alone (max_loras={max_loras})")
        zoo.check(b, "llama", adapter, prompt, context=f"mixed max_loras={max_loras}")
    if max_loras == 1:
        scheduler = llm.llm_engine.scheduler
        # Three adapters through one slot, twice over (batched, then alone): each load
        # replaced the slot's adapter.
        assert scheduler.lora_slots.num_loads >= 3
        llm.llm_engine.shutdown()


def test_the_cpu_decoder_applies_adapters(zoo, llama_llm, monkeypatch):
    """Steps with adapter rows, prompts and decodes alike, run through the C++ decoder,
    which applies each token's adapter after every matmul: the tokens are HF + PEFT's."""
    runner = llama_llm.llm_engine.model_executor.driver_worker.model_runner
    decoder = runner.cpu_decoder
    assert decoder is not None, "the tiny Llama should qualify for the C++ decoder"
    seen = []

    class Spy:
        takes = decoder.takes

        def __call__(self, input_ids, positions, meta, lora_slots=None):
            seen.append((meta.num_prefills, None if lora_slots is None else lora_slots.tolist()))
            return decoder(input_ids, positions, meta, lora_slots)

    monkeypatch.setattr(runner, "cpu_decoder", Spy())
    got, _ = generate(llama_llm, MIXED, zoo=zoo)
    for (prompt, adapter), tokens in zip(MIXED, got):
        zoo.check(tokens, "llama", adapter, prompt, context="C++ decoder")
    mixed_steps = [s for _, s in seen if s is not None and -1 in s and max(s) >= 0]
    assert mixed_steps, f"no step mixed adapters and the base in the decoder: {seen}"
    assert any(p and s is not None and max(s) >= 0 for p, s in seen), \
        f"no prompt with an adapter ran through the decoder: {seen}"


def test_long_adapter_prompt_chunks_run_the_python_layers(zoo, llama_llm, monkeypatch):
    """A prompt chunk of MIN_GEMM_RUN or more tokens of one adapter is multiplied as a GEMM
    pair by the Python layers, not token by token by the C++ decoder; the steps after it
    stay in the decoder. The tokens are HF + PEFT's either way."""
    from pagedlm.layers.lora import MIN_GEMM_RUN

    runner = llama_llm.llm_engine.model_executor.driver_worker.model_runner
    decoder, eager = runner.cpu_decoder, runner._forward_eager
    in_decoder, in_layers = [], []

    class Spy:
        takes = decoder.takes

        def __call__(self, input_ids, positions, meta, lora_slots=None):
            in_decoder.append(meta.num_tokens)
            return decoder(input_ids, positions, meta, lora_slots)

    def layers(inputs):
        in_layers.append(inputs.meta.num_tokens)
        return eager(inputs)

    monkeypatch.setattr(runner, "cpu_decoder", Spy())
    monkeypatch.setattr(runner, "_forward_eager", layers)
    long_prompt = [(7 * i + 3) % 500 + 1 for i in range(MIN_GEMM_RUN + 2)]
    rows = [(long_prompt, "full"), (PROMPTS[1], "qv")]
    got, _ = generate(llama_llm, rows, zoo=zoo)
    for (prompt, adapter), tokens in zip(rows, got):
        zoo.check(tokens, "llama", adapter, prompt, context="long adapter chunk")
    assert in_layers and min(in_layers) >= MIN_GEMM_RUN, in_layers
    assert in_decoder and max(in_decoder) < MIN_GEMM_RUN, in_decoder

    # Decode steps stay in the decoder however many of their rows share an adapter.
    in_decoder.clear()
    in_layers.clear()
    many = [([3 + i % 200, 7], "full") for i in range(MIN_GEMM_RUN + 2)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    generate(llama_llm, many, params, zoo=zoo)
    assert in_layers == [2 * len(many)], in_layers  # the prompts: one run of one adapter
    assert in_decoder.count(len(many)) == 2, in_decoder  # the two decode steps


def test_preemption_with_adapters(zoo):
    """A cache too small for the batch: requests are preempted and come back (perhaps in
    another slot) with the same tokens."""
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4  # K and V, 2 layers, 4 tokens, 2 kv heads of 16, fp32
    llm = LLM(zoo.path("llama"), skip_tokenizer_init=True, block_size=4, num_threads=1,
              kv_cache_memory=14 * block_bytes, max_model_len=40, enable_lora=True,
              max_loras=2, max_lora_rank=MAX_RANK)
    rows = [(PROMPTS[2], "full"), (PROMPTS[1], "rslora"), (PROMPTS[1], None),
            (PROMPTS[2], "qv"), (PROMPTS[0], "full")]
    got, _ = generate(llm, rows, zoo=zoo)
    assert llm.stats().num_preemptions > 0, "the cache was meant to be too small"
    for (prompt, adapter), tokens in zip(rows, got):
        zoo.check(tokens, "llama", adapter, prompt, context="preemption")
    llm.llm_engine.shutdown()


# ----- prefix cache -------------------------------------------------------------------------------

def test_prefix_cache_is_keyed_by_adapter(zoo, llama_llm):
    """The same 22-token prompt (5 full blocks) under A, B, the base model, then A and
    the base again: only the repeats hit, and every run has its own model's tokens."""
    prompt = list(range(400, 422))
    full_blocks = (len(prompt) - 1) // 4 * 4  # the last token is always computed
    runs = [("full", 0), ("rslora", 0), (None, 0), ("full", full_blocks), (None, full_blocks)]
    first = {}
    for adapter, want_hits in runs:
        before = llama_llm.stats().prefix_cache_hits
        tokens, outs = generate(llama_llm, [(prompt, adapter)], zoo=zoo)
        assert llama_llm.stats().prefix_cache_hits - before == want_hits, adapter
        zoo.check(tokens[0], "llama", adapter, prompt, context=f"prefix cache ({want_hits} hits)")
        if adapter in first:
            assert tokens[0] == first[adapter]
        first[adapter] = tokens[0]
    assert len({tuple(t) for t in first.values()}) == 3


# ----- errors ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bad_adapters(zoo, tmp_path_factory) -> dict[str, str]:
    """Adapter directories that must be refused, each with what the error names."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("bad-lora")
    zoo.path("llama")
    zoo.path("gpt2")
    good = zoo.adapters["llama", "qv"]
    bad = {}

    def copy(name):
        path = root / name
        shutil.copytree(good, path)
        return path

    bad["no_config"] = copy("no-config")
    (bad["no_config"] / "adapter_config.json").unlink()
    bad["pickle"] = zoo.make_adapter("llama", "pickled", seed=1, r=4, target_modules=["q_proj"],
                                     save=dict(safe_serialization=False))
    bad["dora"] = zoo.make_adapter("llama", "dora", seed=1, r=4, target_modules=["q_proj"],
                                   use_dora=True)
    bad["rank"] = zoo.make_adapter("llama", "rank16", seed=1, r=16, target_modules=["q_proj"])
    # PEFT saves the LM head's own weight next to its LoRA (save_embedding_layers="auto");
    # without it, the LoRA weights alone.
    bad["lm_head"] = zoo.make_adapter("llama", "lm-head", seed=1, r=4,
                                      target_modules=["q_proj", "lm_head"])
    bad["lm_head_lora_only"] = zoo.make_adapter("llama", "lm-head-lora", seed=1, r=4,
                                                target_modules=["q_proj", "lm_head"],
                                                save=dict(save_embedding_layers=False))
    bad["embed"] = zoo.make_adapter("llama", "embed", seed=1, r=4,
                                    target_modules=["q_proj", "embed_tokens"])
    bad["gpt2"] = zoo.adapters["gpt2", "full"]  # made on another architecture
    for name, edit in (("layer9", "layer"), ("narrow", "shape")):
        path = copy(name)
        tensors = load_file(path / "adapter_model.safetensors")
        key = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
        if edit == "layer":
            for part in "AB":
                k = key.replace("lora_B", f"lora_{part}")
                tensors[k.replace("layers.1", "layers.9")] = tensors.pop(k)
        else:
            tensors[key] = tensors[key][:48].contiguous()  # q_proj has 64 outputs
        save_file(tensors, path / "adapter_model.safetensors")
        bad[name] = path
    return {k: str(v) for k, v in bad.items()}


@pytest.mark.parametrize("case, match", [
    ("missing_dir", "no such directory"),
    ("no_config", "adapter_config.json is missing"),
    ("pickle", "adapter_model.bin is a pickle"),
    ("dora", "DoRA"),
    ("rank", r"rank 16, above max_lora_rank \(8\)"),
    ("layer9", r"model\.layers\.9\.self_attn\.q_proj.*no such linear layer"),
    ("gpt2", r"transformer\.h\.0\.attn\.c_attn.*no such linear layer"),
    ("narrow", r"model\.layers\.1\.self_attn\.q_proj.*(does not fit|output features)"),
    ("lm_head", r"lm_head\.base_layer\.weight.*not a LoRA A/B weight"),
    ("lm_head_lora_only", r"'lm_head'.*not a linear projection"),
    ("embed", r"embed_tokens.*embedding adapters.*not supported"),
])
def test_bad_adapters_are_refused(zoo, llama_llm, bad_adapters, tmp_path, case, match):
    path = str(tmp_path / "nowhere") if case == "missing_dir" else bad_adapters[case]
    lora = LoRARequest(f"bad-{case}", 100, path)
    with pytest.raises(ValueError, match=match):
        llama_llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False,
                           lora_request=lora)
    assert f"bad-{case}" not in llama_llm.llm_engine.core.loras.adapters
    assert_all_blocks_back(llama_llm)


def test_a_bad_adapter_in_a_batch_refuses_the_batch_and_the_engine_goes_on(zoo, llama_llm,
                                                                          bad_adapters):
    good = zoo.request("llama", "full")
    with pytest.raises(ValueError, match="DoRA"):
        llama_llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY,
                           use_tqdm=False, lora_request=[good, LoRARequest("d", 99,
                                                                           bad_adapters["dora"])])
    assert_all_blocks_back(llama_llm)  # the good request queued first was aborted
    # Still right, for adapters (loaded before or after the failures) and the base model.
    rows = [(PROMPTS[1], "full"), (PROMPTS[1], None), (PROMPTS[0], "qv")]
    got, _ = generate(llama_llm, rows, zoo=zoo)
    for (prompt, adapter), tokens in zip(rows, got):
        zoo.check(tokens, "llama", adapter, prompt, context="after refused adapters")


def test_one_name_for_two_adapters_is_refused(zoo, llama_llm):
    first = zoo.request("llama", "full")
    generate(llama_llm, [(PROMPTS[0], "full")], zoo=zoo)
    clash = LoRARequest(first.lora_name, first.lora_int_id, zoo.adapters["llama", "rslora"])
    with pytest.raises(ValueError, match="already loaded"):
        llama_llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False,
                           lora_request=clash)
    same_id = LoRARequest("another-name", first.lora_int_id, zoo.adapters["llama", "rslora"])
    with pytest.raises(ValueError, match=f"lora_int_id {first.lora_int_id} is already used"):
        llama_llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False,
                           lora_request=same_id)
    # The name still means the first adapter.
    got, _ = generate(llama_llm, [(PROMPTS[2], "full")], zoo=zoo)
    zoo.check(got[0], "llama", "full", PROMPTS[2])
    assert_all_blocks_back(llama_llm)


def test_lora_needs_enable_lora(zoo, llama_llm):
    llm = make_llm(zoo.path("llama"), enable_lora=False)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False,
                     lora_request=zoo.request("llama", "full"))
    assert_all_blocks_back(llm)
    # Enabling LoRA does not change the base model's tokens.
    plain = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
    with_lora, _ = generate(llama_llm, [(p, None) for p in PROMPTS], zoo=zoo)
    assert plain == with_lora
    llm.llm_engine.shutdown()


def test_lora_request_list_must_match_prompts(zoo, llama_llm):
    with pytest.raises(ValueError, match="2 lora_requests for 3 prompts"):
        llama_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                           lora_request=[None, zoo.request("llama", "full")])
    assert_all_blocks_back(llama_llm)


def test_bad_lora_request_arguments():
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/tmp")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/tmp")
    with pytest.raises(ValueError, match="max_lora_rank"):
        from pagedlm.config import EngineArgs

        EngineArgs(model="x", enable_lora=True, max_lora_rank=100000)


def test_adapter_config_is_read_like_peft(zoo):
    """Scales as PEFT computes them: alpha / r, alpha / sqrt(r) with rsLoRA, and the
    pattern's rank and alpha where rank_pattern / alpha_pattern name the module."""
    from pagedlm.lora.adapter import load_adapter

    zoo.path("llama")
    for name in ("rslora", "pattern"):
        adapter = load_adapter(zoo.request("llama", name), MAX_RANK)
        cfg = json.loads((zoo.root / f"llama-{name}" / "adapter_config.json").read_text())
        hf = zoo.hf("llama", name)
        for module, lora in adapter.modules.items():
            peft_layer = hf.get_submodule("base_model.model." + module)
            assert lora.rank == peft_layer.r["default"], module
            a = peft_layer.lora_A["default"].weight
            b = peft_layer.lora_B["default"].weight * peft_layer.scaling["default"]
            torch.testing.assert_close(lora.a, a.float())
            torch.testing.assert_close(lora.b, b.float())
        if name == "pattern":
            assert adapter.modules["model.layers.0.self_attn.q_proj"].rank == 8
            assert adapter.modules["model.layers.1.mlp.down_proj"].rank == 2
            assert adapter.modules["model.layers.0.mlp.down_proj"].rank == cfg["r"]
            assert adapter.rank == 8


# ----- tensor parallel ----------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "phi3", "neox", "gpt2", "falcon"])
def test_two_ranks_equal_one(zoo, arch):
    """Column-parallel layers hold their rows of B (per q / k / v or gate / up shard, out
    of HF-fused, head-interleaved or Conv1D checkpoint layouts), row-parallel ones their
    columns of A; two ranks give one rank's tokens, and PEFT's."""
    adapter, other = ("full", "pattern") if arch == "llama" else ("full", "full")
    rows = [(PROMPTS[0], adapter), (PROMPTS[1], None), (PROMPTS[2], other),
            (PROMPTS[1], adapter), (PROMPTS[2], None), (PROMPTS[0], other)]
    runs = []
    for tp in (1, 2):
        llm = make_llm(zoo.path(arch), max_loras=2, tensor_parallel_size=tp)
        try:
            runs.append(generate(llm, rows, LOGPROBS, zoo=zoo, arch=arch))
        finally:
            llm.llm_engine.shutdown()
    (one, _), (two, outs) = runs
    for (prompt, name), a, b, out in zip(rows, two, one, outs):
        assert_same_greedy(a, b, out, f"{arch}/{name}: two ranks vs one")
        zoo.check(a, arch, name, prompt, context="two ranks")
