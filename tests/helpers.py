"""Comparison helpers shared by the model tests."""

from __future__ import annotations

import torch


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
