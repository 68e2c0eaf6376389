"""The command-line flags shared by `pagedlm` subcommands and the benchmarks: the engine's
options and the sampling options, and what they turn into (engine keyword arguments,
SamplingParams).

Light on purpose: the parser of every `pagedlm` command is built from these, so this module
imports no torch.
"""

from __future__ import annotations

import argparse

from pagedlm.config import EXECUTOR_BACKENDS, GiB
from pagedlm.sampling_params import SamplingParams


def parse_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": GiB, "kib": 1 << 10, "mib": 1 << 20, "gib": GiB}
    t = text.strip().lower()
    for suffix in sorted(units, key=len, reverse=True):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * units[suffix])
    return int(t)


def add_engine_args(p: argparse.ArgumentParser, positional_model: bool = True) -> None:
    g = p.add_argument_group("engine")
    model_help = ("HF model directory, .gguf file or Hugging Face repo id org/name "
                  "(default: the embedded SmolLM2-135M-Instruct)")
    if positional_model:
        g.add_argument("model", nargs="?", default=None, help=model_help)
        g.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    else:
        g.add_argument("--model", dest="model_flag", default=None, metavar="MODEL", help=model_help)
    g.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hugging Face repo id MODEL (default: main)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer directory, if not the model's own")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="no tokenizer: prompts as token ids, outputs as token ids")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"],
                   help="weights file format (auto: from the files; dummy: random weights of "
                        "the right shapes, for benchmarks)")
    g.add_argument("--dtype", default="auto",
                   help="compute dtype: auto (float32 on CPU, the model's on GPUs), float32, "
                        "float16, bfloat16")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: a GPU if there is one, else the CPU")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the engine's random sampling (requests without a seed)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context, as far "
                        "as the KV cache holds it)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="most sequences decoding at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="most tokens one step computes (default: CPU 512, GPU 8192)")
    g.add_argument("--max-prefill-tokens-with-decodes", type=int, default=None,
                   help="prompt tokens a step may compute while requests are decoding, so "
                        "no stream waits behind a whole long prompt (default: CPU 64, GPU "
                        "2048; offline runs such as bench throughput: no bound)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' (also prompt_lookup_min, '
                        'prompt_lookup_max, disable_by_batch_size); outputs are unchanged')
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT format) over the base model, chosen per "
                        "request and mixed in one batch")
    g.add_argument("--max-loras", type=int, default=1,
                   help="LoRA adapters resident at once (others load on demand, least "
                        "recently used out)")
    g.add_argument("--max-lora-rank", type=int, default=16,
                   help="highest adapter rank accepted (slots are sized for it)")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="KV cache size in bytes (suffixes K/M/G accepted); CPU default 2G")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of GPU memory the engine may use, KV cache included")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run every step through the model's Python layers: no CUDA graphs on GPUs, "
                        "no C++ decoder on CPU")
    g.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "float16", "bfloat16", "half", "bf16", "fp16", "fp32",
                            "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="KV cache storage type (auto: the model dtype; fp8 = fp8_e4m3: one byte "
                        "per value, with a scale per layer for K and V calibrated at start)")
    g.add_argument("--weight-dtype", default="auto", choices=["auto", "float16", "half", "fp16", "q8"],
                   help="CPU float32 models. float16: linear weights stored in float16 and "
                        "multiplied in float32 (half the weight bytes per step). q8: integer "
                        "matmuls as llama.cpp computes them: GGUF Q4_1/Q8_0 weights as stored "
                        "(others rounded to Q8_0), activations rounded to int8 per 32 values")
    g.add_argument("--num-threads", type=int, default=None,
                   help="CPU threads (per rank with --tensor-parallel-size; default: the "
                        "machine's cores, split evenly between ranks)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model's heads, MLP and vocabulary over this many ranks, one "
                        "worker process each (gloo on CPU, NCCL on GPUs)")
    g.add_argument("--distributed-executor-backend", default=None, choices=EXECUTOR_BACKENDS,
                   help="how ranks run: uni = in the engine's process (1 rank); mp = worker "
                        "processes on this machine; ray = actors on the nodes of a running Ray "
                        "cluster (ray start; RAY_ADDRESS), for several machines (default: uni "
                        "for 1 rank, else mp)")
    g.add_argument("--attention-backend", default="auto",
                   choices=["auto", "cpu", "torch", "triton", "reference"],
                   help="paged-attention implementation (auto: the C++ kernels on CPU, torch on "
                        "GPUs; triton: GPU kernels, which CUDA graphs need)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model_flag or getattr(args, "model", None), revision=args.revision,
        tokenizer=args.tokenizer,
        skip_tokenizer_init=args.skip_tokenizer_init, load_format=args.load_format,
        dtype=args.dtype, device=args.device, seed=args.seed, max_model_len=args.max_model_len,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
        max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        num_threads=args.num_threads, attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype, weight_dtype=args.weight_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        speculative_config=args.speculative_config, enable_lora=args.enable_lora,
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
    )


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens,
                   help="most tokens in a reply")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (the same reply every time); higher: more varied")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of tokens with this much probability")
    g.add_argument("--top-k", type=int, default=0,
                   help="sample from the k most likely tokens (0: all)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this times the most likely one")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="above 1: tokens already in the text become less likely")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="seed of this run's sampling (default: the engine's --seed)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
    )


def describe_sampling(params: SamplingParams) -> str:
    """The sampling settings in one line, as generate and chat state them."""
    parts = ["greedy" if params.temperature == 0 else f"temperature {params.temperature:g}"]
    if params.temperature != 0:
        parts += [f"top-p {params.top_p:g}"] if params.top_p < 1 else []
        parts += [f"top-k {params.top_k}"] if params.top_k > 0 else []
        parts += [f"min-p {params.min_p:g}"] if params.min_p > 0 else []
    if params.repetition_penalty != 1:
        parts.append(f"repetition penalty {params.repetition_penalty:g}")
    parts.append(f"at most {params.max_tokens} tokens")
    return "sampling: " + ", ".join(parts) + " (see --help to change)"
