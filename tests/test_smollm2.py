"""The embedded default model, SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized), end to end."""

import os
import subprocess
import sys

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tests.conftest import requires_smollm2, smollm2_path
from tests.helpers import check_greedy_match, hf_greedy, hf_logprobs_along

pytestmark = [requires_smollm2, pytest.mark.slow]

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colours.",
    "Explain in one sentence what a CPU does.",
    "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory=256 << 20)


@pytest.fixture(scope="module")
def hf_model():
    """HF's own Llama implementation holding the very same dequantized weights."""
    from transformers import LlamaForCausalLM

    from pagedlm.loader.gguf_loader import GGUFCheckpoint

    ckpt = GGUFCheckpoint(smollm2_path())
    with torch.device("meta"):
        model = LlamaForCausalLM(ckpt.config)
    state = dict(ckpt.weights())
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(ckpt.config)  # rebuild buffers off meta
    return model.float().eval()


def test_greedy_equals_hf(llm, hf_model):
    tokenizer = llm.get_tokenizer()
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    for prompt_ids, out in zip(ids, outs):
        ours = out.outputs[0].token_ids
        ref = hf_greedy(hf_model, prompt_ids, 32)
        check_greedy_match(ours, ref, hf_logprobs_along(hf_model, prompt_ids, ref), len(prompt_ids),
                           context="SmolLM2")


def test_three_ranks_equal_one(llm):
    """Tensor parallelism on the real model: 9 heads and 3 KV heads split over 3 ranks give
    the one-rank engine's tokens (which test_greedy_equals_hf checks against HF) and its
    prompt logprobs."""
    tokenizer = llm.get_tokenizer()
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    ids = [{"prompt_token_ids": tokenizer(p, add_special_tokens=False).input_ids} for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, prompt_logprobs=1)
    one = llm.generate(ids, params, use_tqdm=False)
    three = LLM(kv_cache_memory=256 << 20, tensor_parallel_size=3, num_threads=1)
    try:
        outs = three.generate(ids, params, use_tqdm=False)
    finally:
        three.llm_engine.shutdown()
    for a, b in zip(one, outs):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            for t in x:
                assert abs(x[t].logprob - y[t].logprob) < 1e-4


def test_answers_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # it ends with <|im_end|>, not the length cap


def test_stop_string_and_stats(llm):
    out = llm.chat([{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
                   SamplingParams(temperature=0, max_tokens=64, stop=["5"]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "5"
    assert "5" not in c.text and "4" in c.text
    stats = llm.stats()
    assert stats.num_blocks_free == stats.num_blocks_total
    assert stats.num_requests_running == stats.num_requests_waiting == 0


def test_readme_quick_start_command():
    """The README's main command, run as a new user would."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.run(
        [sys.executable, "-m", "pagedlm.entrypoints.cli", "generate", "-p",
         "What is the capital of France?"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout, proc.stdout


def test_beam_search_equals_hf(llm, hf_model):
    from pagedlm import BeamSearchParams
    from tests.test_block_sharing import _hf_beams

    tokenizer = llm.get_tokenizer()
    for question, lp in [("What is the capital of France?", 1.0), ("Name a colour.", 0.5)]:
        ids = tokenizer(llm.apply_chat_template([{"role": "user", "content": question}]),
                        add_special_tokens=False).input_ids
        params = BeamSearchParams(beam_width=4, max_tokens=12, length_penalty=lp)
        ours = llm.beam_search({"prompt_token_ids": ids}, params)[0].sequences
        ref = _hf_beams(hf_model, ids, 4, 12, lp, eos=llm.llm_engine.eos_token_ids[0])
        assert [s.tokens for s in ours] == [r[0] for r in ref], question
        for s, (_, score) in zip(ours, ref):
            assert s.score == pytest.approx(score, abs=1e-3)
        assert ours[0].text.startswith(tokenizer.decode(ids, skip_special_tokens=True)[:10])


def test_cli_chat_session_streams_a_multi_turn_conversation():
    """`pagedlm chat` driven through a pipe: two turns, the second depends on the first."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    script = "What is the capital of France?\nAnd of Italy?\n/exit\n"
    proc = subprocess.run(
        [sys.executable, "-m", "pagedlm.entrypoints.cli", "chat", "--max-tokens", "40"],
        input=script, capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout and "Rome" in proc.stdout, proc.stdout
