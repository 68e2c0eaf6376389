"""Comparison helpers shared by the model tests, the GGUF tests' tiny tokenizer, and the
wait for a test server to come up."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def wait_until_healthy(url: str, proc, timeout_s: float, log: Callable[[], str],
                       interval_s: float = 0.25) -> None:
    """Poll `url`/health until it answers 200; RuntimeError with the server's output
    (`log()`) if the process `proc` exits first or `timeout_s` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not healthy after {timeout_s:.0f} s:\n{log()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)


# GGUF test tokenizer, a byte-level BPE: GPT-2's byte -> unicode spelling, rebuilt here so the
# tests do not lean on the loader's copy, then <|endoftext|> (id 256) and three merges.
def _gpt2_byte_chars() -> list[str]:
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


TINY_TOKENS = [*_gpt2_byte_chars(), "<|endoftext|>", "he", "ll", "Ġw"]
TINY_MERGES = ["h e", "l l", "Ġ w"]


def write_tiny_tokenizer(writer) -> None:
    """The tiny BPE tokenizer as llama.cpp writes a GPT-2-style one into a GGUF file
    (`writer` a gguf.GGUFWriter; token 256, <|endoftext|>, is BOS and EOS)."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types([1] * 256 + [3] + [1] * 3)
    writer.add_token_merges(TINY_MERGES)
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(256)
    writer.add_add_bos_token(False)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' own greedy decode, EOS disabled so lengths match ignore_eos."""
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
        )
    return out[0, len(prompt_ids):].tolist()


def hf_logprobs_along(model, prompt_ids: list[int], continuation: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at every position of prompt + continuation."""
    ids = torch.tensor([prompt_ids + continuation])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # [len, vocab]


def check_greedy_match(ours: list[int], ref: list[int], ref_logprobs: torch.Tensor,
                       prompt_len: int, tie_tolerance: float = 1e-4, context: str = "") -> None:
    """Exact equality, or, at the first divergence, proof that it was a near-tie in fp32.

    vLLM compares the same way (each side's token in the other's top logprobs); we are
    stricter: the two tokens' logprobs under the reference must differ by < tie_tolerance.
    """
    if ours == ref:
        return
    i = next(k for k, (a, b) in enumerate(zip(ours, ref)) if a != b)
    lp = ref_logprobs[prompt_len + i - 1]
    gap = float(lp[ref[i]] - lp[ours[i]])
    assert gap < tie_tolerance, (
        f"{context}: greedy outputs diverge at token {i} ({ours[i]} vs HF {ref[i]}) and it is not "
        f"a near-tie (logprob gap {gap:.3g})\nours {ours}\nHF   {ref}"
    )


def assert_matches_hf(path: str, hf, prompts: list[list[int]], max_tokens: int, context: str) -> None:
    """pagedlm on the checkpoint at `path` against the HF model `hf` on the same weights:
    greedy tokens batched and with chunked prefill (budget 7 tokens, across blocks of 4),
    then prompt logprobs of prompts[1] within 1e-4."""
    import pytest

    from pagedlm import LLM, SamplingParams

    refs = [hf_greedy(hf, p, max_tokens) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for chunk in (None, 7):
        extra = {} if chunk is None else {"max_num_batched_tokens": chunk}
        llm = LLM(path, skip_tokenizer_init=True, block_size=4, kv_cache_memory=1 << 22, **extra)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, ref, out in zip(prompts, refs, outputs):
            ours = out.outputs[0].token_ids
            assert len(ours) == max_tokens
            check_greedy_match(ours, ref, hf_logprobs_along(hf, prompt, ref), len(prompt),
                               context=f"{context} chunk={chunk}")
    prompt = prompts[1]
    lp_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate({"prompt_token_ids": prompt}, lp_params, use_tqdm=False)[0]
    ref = hf_logprobs_along(hf, prompt, [])
    for pos in range(1, len(prompt)):
        got = out.prompt_logprobs[pos][prompt[pos]].logprob
        assert got == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4)


def assert_tokens_equal_or_near_tie(ours: list[int], other: list[int], logprobs,
                                    context: str, tie_tolerance: float = 1e-4) -> None:
    """Two greedy runs' tokens are equal, or part only where `logprobs` (the first run's
    per-position top logprobs, needs logprobs >= 2) shows a near-tie of the two tokens."""
    if ours == other:
        return
    k = next(j for j, (p, q) in enumerate(zip(ours, other)) if p != q)
    lp = logprobs[k]
    assert other[k] in lp, f"{context}: diverges at {k}; {other[k]} not in the top logprobs"
    gap = lp[ours[k]].logprob - lp[other[k]].logprob
    assert gap < tie_tolerance, f"{context}: diverges at {k} without a near-tie (gap {gap})"


def use_triton_interpreter() -> None:
    """Without CUDA, run Triton kernels under its interpreter. Call at the top of a test
    module, before triton (or a kernel module) is imported: Triton picks "compile" or
    "interpret" when @triton.jit decorates a function, i.e. at import (its own helpers
    tl.max, tl.sum, tl.cdiv when `triton` is first imported). Skips the module if triton
    was imported earlier in compiled mode."""
    import os
    import sys

    import pytest

    if torch.cuda.is_available():
        return
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set; run this file "
                    "on its own or with TRITON_INTERPRET=1", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
