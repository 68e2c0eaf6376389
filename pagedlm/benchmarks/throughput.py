"""`pagedlm bench throughput`: offline throughput of pagedlm and its baselines.

``--backend`` names one or more engines; they run one after the other on the very same
requests (sampled once, with pagedlm's tokenizer) and model file, and the result JSON holds
one entry per engine:

    pagedlm            this engine
    hf                 HF transformers ``generate`` with static batches (hf_baseline.py)
    hf-cb              HF transformers continuous batching (hf_cb_baseline.py)
    llama-cpp-python   llama.cpp on the same GGUF, one request at a time (llamacpp_baseline.py)

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

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedlm import LLM, SamplingParams
from pagedlm.benchmarks.common import model_label, result_header, write_json
from pagedlm.benchmarks.dataset_args import build_requests, dataset_info
from pagedlm.benchmarks.datasets import SampleRequest
from pagedlm.benchmarks.hf_baseline import load_hf_model, load_hf_tokenizer, run_hf_static
from pagedlm.benchmarks.hf_cb_baseline import HFCBConfig, run_hf_cb
from pagedlm.benchmarks.llamacpp_baseline import llama_cpp_info, load_llama, run_llama_cpp
from pagedlm.config import DTYPE_ALIASES
from pagedlm.entrypoints.cli_args import engine_kwargs
from pagedlm.loader.gguf_loader import GGUFCheckpoint, default_model_path
from pagedlm.loader.model_loader import resolve_model_source
from pagedlm.loader.tokenizer import load_tokenizer_for


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
                use_tqdm: bool = True, lora_requests: Sequence[Any] | None = None
                ) -> dict[str, Any]:
    """Generate every request with ``llm`` (a :class:`pagedlm.LLM`); count real tokens.
    `lora_requests`: each request's adapter (LoRARequest or None)."""
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
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_requests)
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

BACKENDS = ("pagedlm", "hf", "hf-cb", "llama-cpp-python")


class Workload:
    """The requests every backend of one run gets: sampled once, by the first backend that
    needs them, with pagedlm's tokenizer (ShareGPT) or the model's vocabulary (synthetic)."""

    def __init__(self, args: argparse.Namespace, model: str | None) -> None:
        self.args = args
        self.model = model
        self.requests: list[SampleRequest] | None = None
        self._tokenizer: Any = None

    def tokenizer(self) -> Any | None:
        """pagedlm's tokenizer for the model (None with --skip-tokenizer-init)."""
        if self._tokenizer is None and not self.args.skip_tokenizer_init:
            self._tokenizer = load_tokenizer_for(resolve_model_source(self.model),
                                                 self.args.tokenizer)
        return self._tokenizer

    def get(self, vocab_size: int | None, tokenizer: Any | None = None) -> list[SampleRequest]:
        if self.requests is None:
            if tokenizer is not None:
                self._tokenizer = tokenizer
            elif self.args.dataset == "sharegpt":
                tokenizer = self.tokenizer()
            self.requests = build_requests(self.args, tokenizer, vocab_size)
        return self.requests

    def prompt_ids(self) -> list[list[int]]:
        """Every request's prompt as token ids: its own, or pagedlm's tokenization of its
        text (the ids whose count is ``prompt_len``)."""
        assert self.requests is not None
        ids = []
        for r in self.requests:
            if r.prompt_token_ids is not None:
                ids.append(list(r.prompt_token_ids))
                continue
            encoded = self.tokenizer()(r.prompt)
            row = list(encoded["input_ids"] if isinstance(encoded, dict) else encoded.input_ids)
            assert len(row) == r.prompt_len, (len(row), r.prompt_len)
            ids.append(row)
        return ids


def _run_pagedlm_backend(args: argparse.Namespace, kwargs: dict[str, Any],
                         work: Workload) -> dict[str, Any]:
    if args.enable_prefix_caching is not None:
        kwargs = {**kwargs, "enable_prefix_caching": args.enable_prefix_caching}
    start = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - start
    engine = llm.llm_engine
    requests = work.get(engine.vocab_size, llm.get_tokenizer())
    result = run_pagedlm(llm, requests, args.ignore_eos, not args.disable_tqdm)
    result.update(load_s=load_s, dtype=str(engine.dtype).removeprefix("torch."),
                  engine_args={k: v for k, v in kwargs.items() if k != "model"},
                  max_model_len=engine.max_model_len)
    return result


class _HFModel:
    """The HF model, loaded once for both HF baselines of a run."""

    def __init__(self, model: str | None, dtype: str) -> None:
        self.model, self.load_s = load_hf(model, dtype)


def _run_hf_backend(args: argparse.Namespace, hf: _HFModel, work: Workload) -> dict[str, Any]:
    requests = work.get(hf.model.config.vocab_size)
    hf_tokenizer = (load_hf_text_tokenizer(args.tokenizer or work.model)
                    if requests[0].prompt_token_ids is None else None)
    result = run_hf(hf.model, hf_tokenizer, requests, args.hf_max_batch_size,
                    args.num_threads, not args.disable_tqdm)
    result.update(load_s=hf.load_s, dtype=str(hf.model.dtype).removeprefix("torch."),
                  hf_max_batch_sizes=list(args.hf_max_batch_size))
    return result


def _run_hf_cb_backend(args: argparse.Namespace, hf: _HFModel, work: Workload
                       ) -> dict[str, Any]:
    config = HFCBConfig(attn_implementation=args.hf_cb_attn, page_size=args.hf_cb_page_size,
                        num_blocks=args.hf_cb_num_blocks,
                        max_batch_tokens=args.hf_cb_max_batch_tokens,
                        max_requests_per_batch=args.hf_cb_max_requests_per_batch)
    requests = work.get(hf.model.config.vocab_size)
    result = run_hf_cb(hf.model, work.prompt_ids(), requests, config, args.ignore_eos,
                       args.num_threads, args.seed, not args.disable_tqdm)
    result.update(load_s=hf.load_s, dtype=str(hf.model.dtype).removeprefix("torch."))
    return result


def _run_llama_cpp_backend(args: argparse.Namespace, work: Workload) -> dict[str, Any]:
    path = work.model if work.model is not None else str(default_model_path())
    threads = args.num_threads or torch.get_num_threads()
    requests = work.requests
    if requests is None:
        synthetic = args.dataset != "sharegpt"
        requests = work.get(GGUFCheckpoint(path).config.vocab_size if synthetic else None)
    # The context holds the longest request, rounded up.
    n_ctx = args.llama_cpp_n_ctx or -(-max(r.prompt_len + r.output_len for r in requests)
                                      // 256) * 256
    llm, load_s = load_llama(path, n_ctx, threads, seed=args.seed)
    try:
        result = run_llama_cpp(llm, work.prompt_ids(), requests, args.ignore_eos,
                               not args.disable_tqdm)
        result.update(load_s=load_s, dtype="gguf (llama.cpp kernels on the file's own types)",
                      n_ctx=n_ctx, n_threads=threads, **llama_cpp_info(llm))
    finally:
        llm.close()
    return result


def _print_summary(name: str, r: dict[str, Any]) -> None:
    print(f"{name}: {r['elapsed_s']:.2f} s, {r['requests_per_s']:.2f} requests/s, "
          f"{r['total_tokens_per_s']:.1f} total tokens/s, "
          f"{r['output_tokens_per_s']:.1f} output tokens/s")


def main(args: argparse.Namespace) -> int:
    """Run `pagedlm bench throughput`; returns the exit status."""
    kwargs = engine_kwargs(args)
    model = kwargs["model"]
    backends = list(dict.fromkeys(args.backend))
    if any(b < 1 for b in args.hf_max_batch_size):
        raise ValueError(f"--hf-max-batch-size values must be >= 1, got {args.hf_max_batch_size}")
    if args.label and len(backends) > 1:
        raise ValueError("--label names one backend's run; with several --backend values "
                         "each run is named after its backend")
    if "llama-cpp-python" in backends and not _is_gguf(model):
        raise ValueError(f"the llama-cpp-python backend needs a .gguf model, got {model!r}")
    if args.skip_tokenizer_init and args.dataset == "sharegpt":
        raise ValueError("the sharegpt dataset counts tokens with a tokenizer; drop "
                         "--skip-tokenizer-init or use --dataset random")
    work = Workload(args, model)
    hf: _HFModel | None = None
    results: dict[str, dict[str, Any]] = {}
    for i, backend in enumerate(backends):
        if backend == "pagedlm":
            result = _run_pagedlm_backend(args, kwargs, work)
        elif backend == "llama-cpp-python":
            result = _run_llama_cpp_backend(args, work)
        else:
            if hf is None:
                hf = _HFModel(model, args.dtype)
            runner = _run_hf_backend if backend == "hf" else _run_hf_cb_backend
            result = runner(args, hf, work)
        if not {"hf", "hf-cb"} & set(backends[i + 1:]):
            hf = None  # free the HF model once no later backend needs it
        gc.collect()
        label = args.label or backend
        results[label] = result
        _print_summary(label, result)

    assert work.requests is not None
    first = next(iter(results.values()))
    report = result_header(
        "throughput", model=model_label(model), dtype=first["dtype"], dataset=args.dataset,
        num_prompts=len(work.requests), seed=args.seed, threads=torch.get_num_threads(),
        backends=backends, label=args.label, ignore_eos=args.ignore_eos,
        dataset_info=dataset_info(args),
    )
    report["results"] = results
    if args.output_json:
        print(f"wrote {write_json(args.output_json, report)}")
    return 0
