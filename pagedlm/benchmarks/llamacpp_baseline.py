"""llama.cpp baseline through ``llama-cpp-python``: one request at a time, same GGUF file.

llama-cpp-python's ``Llama`` holds one sequence, so requests run back to back: the prompt
is evaluated in ``n_batch`` chunks, then one token per decode.  Each request's prompt is
handed over as token ids (pagedlm's tokenization of the same text), and ``Llama.generate``
is iterated for exactly ``output_len`` tokens: ``generate`` itself never stops at EOS, so
that is "ignore EOS"; without it, generation stops after the first end-of-generation
token.  Sampling: temperature 1, top-p 1, top-k and min-p off, as pagedlm's benchmark.

Install it with ``benchmarks/build_llama_cpp.sh`` (which compiles llama.cpp once for this
and for ``llama-server``) or ``pip install 'pagedlm[llamacpp]'``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from tqdm import tqdm

from pagedlm.benchmarks.datasets import SampleRequest


def llama_cpp_available() -> bool:
    try:
        metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return False
    return True


def load_llama(model_path: str, n_ctx: int, n_threads: int, seed: int = 0,
               n_batch: int = 512) -> tuple[Any, float]:
    """A ``llama_cpp.Llama`` on ``model_path``; returns (llm, load seconds)."""
    try:  # the llamacpp extra
        from llama_cpp import Llama
    except ImportError as e:
        raise ValueError("the llama-cpp-python baseline needs llama-cpp-python: run "
                         "benchmarks/build_llama_cpp.sh or pip install 'pagedlm[llamacpp]' "
                         f"({e})") from None
    start = time.perf_counter()
    llm = Llama(model_path=model_path, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads,
                n_threads_batch=n_threads, seed=seed, verbose=False)
    return llm, time.perf_counter() - start


def llama_cpp_info(llm: Any | None = None) -> dict[str, Any]:
    """llama-cpp-python's version and, with a loaded model, llama.cpp's system info
    (the CPU features it was built for)."""
    info: dict[str, Any] = {}
    try:
        info["llama_cpp_python"] = metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        info["llama_cpp_python"] = None
    if llm is not None:
        import llama_cpp  # the llamacpp extra (a loaded model means it is installed)

        info["llama_cpp_system_info"] = llama_cpp.llama_print_system_info().decode().strip()
    return info


def generate_one(llm: Any, prompt_ids: Sequence[int], max_tokens: int,
                 ignore_eos: bool = True) -> list[int]:
    """Sample up to ``max_tokens`` tokens after ``prompt_ids``; the tokens, EOS included."""
    out: list[int] = []
    if max_tokens < 1:
        return out
    eos = llm.token_eos()
    for token in llm.generate(list(prompt_ids), top_k=0, top_p=1.0, min_p=0.0, temp=1.0,
                              repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if len(out) >= max_tokens or (not ignore_eos and token == eos):
            break
    return out


def run_llama_cpp(llm: Any, prompt_ids: Sequence[Sequence[int]],
                  requests: Sequence[SampleRequest], ignore_eos: bool = True,
                  use_tqdm: bool = True) -> dict[str, Any]:
    """Generate every request, one at a time, and return throughput figures counted from
    the tokens llama.cpp produced (and detokenized, as a client would)."""
    if len(prompt_ids) != len(requests):
        raise ValueError(f"{len(prompt_ids)} prompts for {len(requests)} requests")
    too_long = [i for i, (p, r) in enumerate(zip(prompt_ids, requests))
                if len(p) + r.output_len > llm.n_ctx()]
    if too_long:
        i = too_long[0]
        raise ValueError(f"request {i} needs {len(prompt_ids[i]) + requests[i].output_len} "
                         f"tokens but the llama.cpp context holds {llm.n_ctx()}")
    # One short untimed request first (first-call costs), as the other engines get.
    generate_one(llm, prompt_ids[0], min(2, requests[0].output_len))
    generated = 0
    start = time.perf_counter()
    for ids, request in tqdm(list(zip(prompt_ids, requests)), desc="llama.cpp",
                             disable=not use_tqdm):
        tokens = generate_one(llm, ids, request.output_len, ignore_eos)
        llm.detokenize(tokens)
        generated += len(tokens)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in prompt_ids)
    return {
        "elapsed_s": elapsed,
        "num_requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": generated,
        "requested_output_tokens": sum(r.output_len for r in requests),
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (prompt_tokens + generated) / elapsed,
    }
