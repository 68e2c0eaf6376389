"""HF transformers baseline with static batching, shaped like vLLM's throughput benchmark.

Requests are taken in order and packed into static batches; each batch is left-padded
and run through ``model.generate`` until its longest requested output is reached.  The
model is built from the same SmolLM2 GGUF file that pagedlm serves, dequantized to fp32.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedlm.benchmarks.datasets import MAX_TOTAL_LEN, SampleRequest
from pagedlm.loader.default_model import default_model_path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """The embedded default model's GGUF (fetched once if it is not here yet)."""
    return Path(default_model_path())


def load_hf_tokenizer(gguf_path: str | Path | None = None) -> Any:
    """The HF tokenizer built from the GGUF's vocabulary, set up for left padding."""
    path = Path(gguf_path) if gguf_path is not None else smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # Decoder-only batches must be left-padded so every row's last token is real.
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_hf_model(
    gguf_path: str | Path | None = None, dtype: torch.dtype = torch.float32
) -> tuple[Any, float]:
    """Load the HF model from the GGUF (dequantized to ``dtype``); returns (model, seconds)."""
    path = Path(gguf_path) if gguf_path is not None else smollm2_gguf_path()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    model.eval()
    return model, time.perf_counter() - start


def plan_static_batches(
    requests: Sequence[SampleRequest], max_batch_size: int, max_total: int = MAX_TOTAL_LEN
) -> list[list[int]]:
    """Pack request indices, in order, into static batches.

    A batch takes the next request while it holds fewer than ``max_batch_size`` requests
    and its longest prompt plus its longest output (the padded length every row reaches)
    stays within ``max_total``.  A request too long on its own still gets a batch.
    """
    if max_batch_size < 1:
        raise ValueError("max_batch_size must be >= 1")
    batches: list[list[int]] = []
    current: list[int] = []
    max_prompt = max_output = 0
    for i, req in enumerate(requests):
        new_prompt = max(max_prompt, req.prompt_len)
        new_output = max(max_output, req.output_len)
        if current and (len(current) >= max_batch_size or new_prompt + new_output > max_total):
            batches.append(current)
            current = []
            new_prompt, new_output = req.prompt_len, req.output_len
        current.append(i)
        max_prompt, max_output = new_prompt, new_output
    if current:
        batches.append(current)
    return batches


@torch.inference_mode()
def run_hf_static(
    model: Any,
    tokenizer: Any,
    requests: Sequence[SampleRequest],
    max_batch_size: int = 16,
    num_threads: int | None = 2,
    use_tqdm: bool = True,
) -> dict[str, float | int]:
    """Generate every request with HF static batching and return throughput figures.

    ``output_tokens`` is the sum of the requested output lengths (as vLLM counts it);
    rows shorter than their batch's longest output still decode to the batch's end, and
    generation stops early only if every row hits EOS, which ``padded_generated_tokens`` versus
    ``padded_planned_tokens`` reveals.
    """
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id
    tokenizer.padding_side = "left"
    batches = plan_static_batches(requests, max_batch_size)

    padded_generated_tokens = planned_tokens = 0
    pbar = tqdm(total=len(requests), desc="HF static batches", disable=not use_tqdm)
    start = time.perf_counter()
    for batch in batches:
        reqs = [requests[i] for i in batch]
        max_new = max(r.output_len for r in reqs)
        enc = tokenizer([r.prompt for r in reqs], return_tensors="pt", padding=True)
        # The mask must be passed explicitly: pad == eos for SmolLM2, so HF cannot infer
        # it, and attending to left padding would change the outputs.
        out = model.generate(
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"],
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,  # HF's default top-k is 50; every engine here samples the full vocab
            max_new_tokens=max_new,
            use_cache=True,
            pad_token_id=pad_id,
        )
        # Detokenize like a real client would, so the baseline pays the same costs.
        tokenizer.batch_decode(out, skip_special_tokens=True)
        padded_generated_tokens += (out.shape[1] - enc["input_ids"].shape[1]) * len(reqs)
        planned_tokens += max_new * len(reqs)
        pbar.update(len(reqs))
    elapsed = time.perf_counter() - start
    pbar.close()

    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(r.output_len for r in requests)
    return {
        "elapsed_s": elapsed,
        "num_requests": len(requests),
        "num_batches": len(batches),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "padded_generated_tokens": padded_generated_tokens,
        "padded_planned_tokens": planned_tokens,
    }
