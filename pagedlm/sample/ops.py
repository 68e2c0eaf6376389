"""Row-wise logits operations the sampler composes: min_p, top-k / top-p, the
repetition, frequency and presence penalties, and logprobs.

All are out-of-place and row-wise: row r of the result depends only on row r of the
inputs, so a row's token never depends on the batch it shares.
"""

from __future__ import annotations

import torch


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token whose probability is below min_p * (max probability).

    logits: [num_rows, vocab]; min_p: [num_rows] float32 in [0, 1] (0 = disabled).
    Done in log space: p_i < min_p * p_max  <=>  logit_i - logit_max < log(min_p),
    which needs no softmax and has no underflow at tiny temperatures.
    """
    max_logit = logits.amax(dim=-1, keepdim=True)  # [num_rows, 1]
    threshold = max_logit + torch.log(min_p.to(logits.dtype))[:, None]  # [num_rows, 1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,
    k: torch.Tensor | None,
    p: torch.Tensor | None,
    max_k: int | None = None,
) -> torch.Tensor:
    """Top-k, then top-p (over the renormalised top-k distribution), as -inf masks.

    logits: [num_rows, vocab]. k: [num_rows] int64, a value <= 0 or >= vocab
    disables top-k for that row. p: [num_rows] float32 in (0, 1], 1 disables.
    max_k: the largest enabled k, if the caller knows it on the host (avoids a
    device sync and lets top-k alone use `topk` instead of a full sort).

    Top-p keeps the smallest prefix of tokens, by descending probability, whose
    cumulative probability reaches p; always at least one token. Both filters are
    applied as a threshold on logit values, so tokens tied with the last kept
    token are kept too; that makes the mask independent of how ties are ordered.
    """
    if k is None and p is None:
        return logits
    vocab = logits.shape[-1]
    neg_inf = float("-inf")
    if k is not None:
        k_disabled = (k <= 0) | (k >= vocab)  # [num_rows]

    if p is None:
        assert k is not None
        if max_k is None:
            enabled = k.masked_fill(k_disabled, 0)
            max_k = int(enabled.max().item()) if enabled.numel() else 0
        if max_k <= 0:
            return logits
        max_k = min(max_k, vocab)
        top = logits.topk(max_k, dim=-1).values  # [num_rows, max_k], descending
        idx = (k.clamp(1, max_k) - 1)[:, None]  # [num_rows, 1]
        kth = top.gather(1, idx)  # [num_rows, 1]
        kth = kth.masked_fill(k_disabled[:, None], neg_inf)
        return logits.masked_fill(logits < kth, neg_inf)

    # Top-p needs the whole sorted row; only values are needed, never indices,
    # because the result is applied as a value threshold.
    sorted_logits = logits.sort(dim=-1, descending=True).values  # [num_rows, vocab]
    if k is not None:
        idx = (k.clamp(1, vocab) - 1)[:, None]  # [num_rows, 1]
        kth = sorted_logits.gather(1, idx).masked_fill(
            k_disabled[:, None], neg_inf
        )  # [num_rows, 1]
        # Still sorted after masking: everything below kth is a suffix.
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, neg_inf)
        logits = logits.masked_fill(logits < kth, neg_inf)
    probs = sorted_logits.softmax(dim=-1)  # [num_rows, vocab]
    cum = probs.cumsum(dim=-1)  # [num_rows, vocab]
    # Probability mass strictly before each position; shifting cum (rather than
    # cum - probs) keeps it monotone in float arithmetic.
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # [num_rows, vocab]
    p_col = p.to(probs.dtype)[:, None]  # [num_rows, 1]
    num_keep = (before < p_col).sum(dim=-1, keepdim=True).clamp(min=1)  # [num_rows, 1]
    threshold = sorted_logits.gather(1, num_keep - 1)  # [num_rows, 1]
    # p == 1 must keep everything even if rounding pushes cum past 1 early.
    threshold = threshold.masked_fill(p_col >= 1.0, neg_inf)
    return logits.masked_fill(logits < threshold, neg_inf)


def apply_repetition_penalty(
    logits: torch.Tensor, seen_mask: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """logits: [num_rows, vocab]; seen_mask: [num_rows, vocab] bool, tokens in the
    prompt or output; penalty: [num_rows] float32 (> 0, 1 = disabled).
    Seen tokens with a positive logit are divided by the penalty, others multiplied,
    so a penalty > 1 always makes a seen token less likely."""
    pen = penalty.to(logits.dtype)[:, None]  # [num_rows, 1]
    penalised = torch.where(logits > 0, logits / pen, logits * pen)  # [num_rows, vocab]
    return torch.where(seen_mask, penalised, logits)


def apply_frequency_presence_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """logits - frequency * count - presence * (count > 0), counting output tokens.

    output_counts: [num_rows, vocab] (any numeric dtype); frequency, presence: [num_rows].
    """
    counts = output_counts.to(logits.dtype)  # [num_rows, vocab]
    freq = frequency.to(logits.dtype)[:, None]  # [num_rows, 1]
    pres = presence.to(logits.dtype)[:, None]  # [num_rows, 1]
    return logits - freq * counts - pres * (counts > 0).to(logits.dtype)


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of given tokens plus the top `num_top` per row (also for prompt logprobs).

    logits: [N, vocab]; token_ids: [N] int64.
    Returns (token_logprobs [N] float32, ranks [N] int64, topk_ids [N, num_top] int64,
    topk_logprobs [N, num_top] float32). The rank is 1 + the number of tokens with a
    strictly greater logprob, so tied tokens share a rank; top-k is sorted descending.
    """
    if num_top < 0:
        raise ValueError(f"num_top must be >= 0, got {num_top}")
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [N, vocab]
    token_lp = logprobs.gather(1, token_ids.to(torch.int64)[:, None])  # [N, 1]
    ranks = (logprobs > token_lp).sum(dim=-1) + 1  # [N]
    num_top = min(num_top, logprobs.shape[-1])
    top_lp, top_ids = logprobs.topk(num_top, dim=-1)  # [N, num_top] each
    return token_lp.squeeze(1), ranks.to(torch.int64), top_ids, top_lp
