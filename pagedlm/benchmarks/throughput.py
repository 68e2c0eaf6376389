"""`pagedlm bench throughput`: offline throughput of pagedlm or the HF static-batching baseline.

Every request is submitted at once; only generation is timed (model loading is reported
separately as ``load_s``).  Sampling is temperature 1, top-p 1 and, by default, EOS is
ignored so every request generates exactly its output length, as vLLM's benchmark does.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pagedlm.benchmarks.common import model_label, result_header, write_json
from pagedlm.benchmarks.datasets import SampleRequest


def throughput_figures(elapsed_s: float, num_requests: int, prompt_tokens: int,
                       output_tokens: int) -> dict[str, float | int]:
    """requests/s, output tokens/s and total (prompt + output) tokens/s over ``elapsed_s``."""
    return {
        "elapsed_s": elapsed_s,
        "num_requests": num_requests,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": num_requests / elapsed_s,
        "output_tokens_per_s": output_tokens / elapsed_s,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed_s,
    }


# --- pagedlm ------------------------------------------------------------------------------


def run_pagedlm(llm: Any, requests: Sequence[SampleRequest], ignore_eos: bool = True,
                use_tqdm: bool = True) -> dict[str, Any]:
    """Generate every request with ``llm`` (a :class:`pagedlm.LLM`); count real tokens."""
    from pagedlm import SamplingParams

    prompts: list[str | dict] = [
        {"prompt_token_ids": list(r.prompt_token_ids)} if r.prompt_token_ids is not None
        else r.prompt
        for r in requests
    ]
    params = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=r.output_len,
                             ignore_eos=ignore_eos) for r in requests]
    # One short untimed request first (first-call costs), as the HF baseline gets too.
    llm.generate(prompts[:1], SamplingParams(max_tokens=min(2, requests[0].output_len)),
                 use_tqdm=False)
    llm.llm_engine.reset_prefix_cache()  # the timed run must not hit the warm-up's prompt
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    # Count what the engine produced, not what was asked: an engine stopping early must
    # not look faster than it is.
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    result: dict[str, Any] = throughput_figures(elapsed, len(requests), prompt_tokens, generated)
    result["requested_output_tokens"] = sum(r.output_len for r in requests)
    stats = llm.stats()
    result["num_preemptions"] = stats.num_preemptions
    result["prefix_cache_hit_rate"] = stats.prefix_cache_hit_rate
    return result


# --- HF transformers -----------------------------------------------------------------------


class PretokenizedPrompts:
    """Stands in for the tokenizer of ``run_hf_static`` when requests carry token ids.

    ``run_hf_static`` tokenizes ``request.prompt``; :meth:`requests` gives each request the
    key ``"#<index>"`` as its prompt, and calling this object looks the ids back up and
    left-pads them, so HF runs exactly the token ids pagedlm runs.
    """

    padding_side = "left"

    def __init__(self, requests: Sequence[SampleRequest], pad_token_id: int) -> None:
        self._ids = [list(r.prompt_token_ids or ()) for r in requests]
        self.pad_token_id = pad_token_id
        self.eos_token_id = pad_token_id

    def requests(self, requests: Sequence[SampleRequest]) -> list[SampleRequest]:
        return [replace(r, prompt=f"#{i}") for i, r in enumerate(requests)]

    def __call__(self, keys: Sequence[str], **_: Any) -> dict[str, Any]:
        import torch

        rows = [self._ids[int(k[1:])] for k in keys]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row):] = torch.tensor(row)  # [width] left-padded
            mask[i, width - len(row):] = 1
        return {"input_ids": input_ids, "attention_mask": mask}

    def batch_decode(self, *_: Any, **__: Any) -> list[str]:
        return []  # a client of token ids has nothing to detokenize


def _is_gguf(model: str | None) -> bool:
    return model is None or model.endswith(".gguf")


def load_hf_text_tokenizer(path: str | None) -> Any:
    """An HF tokenizer set up for left padding, from a .gguf file (None: the embedded
    default) or a HF directory."""
    from transformers import AutoTokenizer

    from pagedlm.benchmarks.hf_baseline import load_hf_tokenizer

    if _is_gguf(path):
        return load_hf_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_hf(model: str | None, dtype: str) -> tuple[Any, float]:
    """The HF model, dequantized from a GGUF (None: the embedded default) or from a HF
    directory; returns (model, load seconds)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedlm.benchmarks.hf_baseline import load_hf_model
    from pagedlm.config import DTYPE_ALIASES

    dtypes = {"auto": torch.float32, "float32": torch.float32,
              "float16": torch.float16, "bfloat16": torch.bfloat16}
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in dtypes:
        raise ValueError(f"--dtype must be one of {', '.join(dtypes)}, got {dtype!r}")
    torch_dtype = dtypes[name]
    if _is_gguf(model):
        return load_hf_model(model, dtype=torch_dtype)
    start = time.perf_counter()
    hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).eval()
    return hf_model, time.perf_counter() - start


def run_hf(hf_model: Any, tokenizer: Any | None, requests: Sequence[SampleRequest],
           batch_sizes: Sequence[int], num_threads: int | None,
           use_tqdm: bool = True) -> dict[str, Any]:
    """Run the static-batching baseline at each batch size; the best (by output tokens/s)
    is the result, every run is kept under ``sweep``."""
    from pagedlm.benchmarks.hf_baseline import run_hf_static

    if tokenizer is None or requests[0].prompt_token_ids is not None:
        eos = getattr(hf_model.config, "eos_token_id", None)
        pad = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)
        tokenizer = PretokenizedPrompts(requests, pad)
        requests = tokenizer.requests(requests)
    # One short untimed batch first, so the first batch size does not pay the warm-up.
    warmup = replace(requests[0], output_len=min(2, requests[0].output_len))
    run_hf_static(hf_model, tokenizer, [warmup], max_batch_size=1, num_threads=num_threads,
                  use_tqdm=False)
    sweep = []
    for batch_size in batch_sizes:
        result = run_hf_static(hf_model, tokenizer, requests, max_batch_size=batch_size,
                               num_threads=num_threads, use_tqdm=use_tqdm)
        result["max_batch_size"] = batch_size
        sweep.append(result)
        print(f"HF static batching, batch size {batch_size}: "
              f"{result['output_tokens_per_s']:.1f} output tokens/s")
    best = max(sweep, key=lambda r: r["output_tokens_per_s"])
    return {**best, "sweep": sweep}


# --- the command ---------------------------------------------------------------------------


def _print_summary(name: str, r: dict[str, Any]) -> None:
    print(f"{name}: {r['elapsed_s']:.2f} s, {r['requests_per_s']:.2f} requests/s, "
          f"{r['total_tokens_per_s']:.1f} total tokens/s, "
          f"{r['output_tokens_per_s']:.1f} output tokens/s")


def main(args: argparse.Namespace) -> int:
    """Run `pagedlm bench throughput`; returns the exit status."""
    import torch

    from pagedlm.benchmarks.cli import build_requests, dataset_info
    from pagedlm.entrypoints.cli import engine_kwargs

    kwargs = engine_kwargs(args)
    model = kwargs["model"]
    if any(b < 1 for b in args.hf_max_batch_size):
        raise ValueError(f"--hf-max-batch-size values must be >= 1, got {args.hf_max_batch_size}")
    use_tqdm = not args.disable_tqdm
    label = args.label or args.backend

    if args.backend == "pagedlm":
        from pagedlm import LLM

        if args.enable_prefix_caching is not None:
            kwargs["enable_prefix_caching"] = args.enable_prefix_caching
        start = time.perf_counter()
        llm = LLM(**kwargs)
        load_s = time.perf_counter() - start
        engine = llm.llm_engine
        requests = build_requests(args, llm.get_tokenizer(), engine.vocab_size)
        result = run_pagedlm(llm, requests, args.ignore_eos, use_tqdm)
        dtype = str(engine.dtype).removeprefix("torch.")
        extra: dict[str, Any] = {"engine_args": {k: v for k, v in kwargs.items() if k != "model"},
                                 "max_model_len": engine.max_model_len}
        del llm, engine
    else:
        from pagedlm.loader.model_loader import load_tokenizer_for, resolve_model_source

        if args.skip_tokenizer_init and args.dataset == "sharegpt":
            raise ValueError("the sharegpt dataset counts tokens with a tokenizer; drop "
                             "--skip-tokenizer-init or use --dataset random")
        need_text = args.dataset == "sharegpt"
        hf_model, load_s = load_hf(model, args.dtype)
        hf_tokenizer = load_hf_text_tokenizer(args.tokenizer or model) if need_text else None
        # Sample with pagedlm's tokenizer so both backends get the very same requests.
        sampler = None
        if need_text:
            sampler = load_tokenizer_for(resolve_model_source(model), args.tokenizer)
        requests = build_requests(args, sampler, hf_model.config.vocab_size)
        result = run_hf(hf_model, hf_tokenizer, requests, args.hf_max_batch_size,
                        args.num_threads, use_tqdm)
        dtype = str(hf_model.dtype).removeprefix("torch.")
        extra = {"hf_max_batch_sizes": list(args.hf_max_batch_size)}
        del hf_model
    gc.collect()
    result["load_s"] = load_s
    _print_summary(label, result)

    report = result_header(
        "throughput", model=model_label(model), dtype=dtype, dataset=args.dataset,
        num_prompts=len(requests), seed=args.seed, threads=torch.get_num_threads(),
        backend=args.backend, label=label, ignore_eos=args.ignore_eos,
        dataset_info=dataset_info(args), **extra,
    )
    report["results"] = {label: result}
    if args.output_json:
        print(f"wrote {write_json(args.output_json, report)}")
    return 0
