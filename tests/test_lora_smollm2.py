"""The embedded SmolLM2 with a LoRA adapter on every projection: greedy tokens equal HF
transformers + PEFT (the adapter applied, not merged) on the same dequantized weights,
and the base model's tokens in the same batch are unchanged."""

from __future__ import annotations

import pytest
import torch

from pagedlm import LLM, LoRARequest, SamplingParams
from tests.conftest import requires_smollm2, smollm2_path
from tests.helpers import check_greedy_match, hf_greedy, hf_logprobs_along

pytestmark = [requires_smollm2, pytest.mark.slow]

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]
MAX_TOKENS = 24


def _hf_smollm2():
    from transformers import LlamaForCausalLM

    from pagedlm.loader.gguf_loader import GGUFCheckpoint

    ckpt = GGUFCheckpoint(smollm2_path())
    with torch.device("meta"):
        model = LlamaForCausalLM(ckpt.config)
    state = dict(ckpt.weights())
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.load_state_dict(state, strict=True, assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(ckpt.config)
    return model.float().eval()


@pytest.fixture(scope="module")
def peft_and_adapter(tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(_hf_smollm2(), LoraConfig(
        r=16, lora_alpha=32, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]))
    path = tmp_path_factory.mktemp("smollm2-lora")
    model.save_pretrained(path)
    return model.eval(), str(path)


def test_greedy_equals_peft_and_base_rows_are_unchanged(peft_and_adapter):
    peft_model, path = peft_and_adapter
    llm = LLM(kv_cache_memory=256 << 20, enable_lora=True, max_lora_rank=16)
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer(llm.apply_chat_template([{"role": "user", "content": q}]),
                     add_special_tokens=False).input_ids for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    lora = LoRARequest("smol-adapter", 1, path)
    prompts = [{"prompt_token_ids": i} for i in ids]
    # Each question with the adapter and without, in one batch.
    outs = llm.generate(prompts * 2, params, use_tqdm=False,
                        lora_request=[lora] * len(ids) + [None] * len(ids))
    with peft_model.disable_adapter():
        base_refs = [(hf_greedy(peft_model, i, MAX_TOKENS), None) for i in ids]
        base_refs = [(ref, hf_logprobs_along(peft_model, i, ref))
                     for i, (ref, _) in zip(ids, base_refs)]
    for k, prompt_ids in enumerate(ids):
        ours = outs[k].outputs[0].token_ids
        ref = hf_greedy(peft_model, prompt_ids, MAX_TOKENS)
        check_greedy_match(ours, ref, hf_logprobs_along(peft_model, prompt_ids, ref),
                           len(prompt_ids), context="SmolLM2 + LoRA")
        base = outs[len(ids) + k].outputs[0].token_ids
        check_greedy_match(base, base_refs[k][0], base_refs[k][1], len(prompt_ids),
                           context="SmolLM2 base rows next to LoRA rows")
        assert ours != base, "the adapter changed nothing: the comparison proves nothing"
