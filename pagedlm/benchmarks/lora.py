"""`pagedlm bench lora`: serving many LoRA adapters against the base model alone, in one run.

The same ShareGPT requests (temperature 1, EOS ignored, as `bench throughput`) go
  * base: through an engine without LoRA;
  * lora: through an engine with --enable-lora, spread round-robin over --num-adapters
    adapters of rank --lora-rank on every attention and MLP projection, mixed in its
    batches (max_loras = the number of adapters, so all stay resident);
and the output tokens/s of the two give the ratio lora / base (--pairs runs of each,
alternating; the median ratio). Adapters are random (the
cost does not depend on the values), written in PEFT's format to a temporary directory.
Also measured: the cost of adding an adapter (reading it and checking it against the
model) and of writing it into a slot on the worker, each the median of --load-repeats.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pagedlm import LLM, LoRARequest
from pagedlm.benchmarks.common import model_label, result_header, write_json
from pagedlm.benchmarks.datasets import load_sharegpt_records, sample_sharegpt
from pagedlm.benchmarks.throughput import run_pagedlm
from pagedlm.entrypoints.cli_args import engine_kwargs
from pagedlm.lora.adapter import load_adapter

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _module_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """HF Llama-family projection -> (in, out)."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", heads)
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def write_random_adapter(path: Path, hf_config, rank: int, seed: int) -> None:
    """A PEFT LoRA adapter directory for a Llama-family model, random weights."""
    gen = torch.Generator().manual_seed(seed)
    shapes = _module_shapes(hf_config)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for name in TARGETS:
            part = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            fan_in, fan_out = shapes[name]
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "bias": "none", "task_type": "CAUSAL_LM"}))


def main(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.num_adapters < 1 or args.pairs < 1:
        raise ValueError("--num-prompts, --num-adapters and --pairs must be >= 1")
    kwargs = engine_kwargs(args)
    for key in ("enable_lora", "max_loras", "max_lora_rank"):
        kwargs.pop(key)
    base = LLM(**kwargs)
    tokenizer = base.get_tokenizer()
    requests = sample_sharegpt(tokenizer, args.num_prompts, seed=args.seed,
                               records=load_sharegpt_records(args.dataset_path))
    if args.max_output_len is not None:
        requests = [dataclasses.replace(r, output_len=min(r.output_len, args.max_output_len))
                    for r in requests]
    report = result_header("lora", model=model_label(kwargs.get("model")),
                           dtype=kwargs.get("dtype"), dataset="sharegpt",
                           num_prompts=args.num_prompts, seed=args.seed,
                           threads=kwargs.get("num_threads"), num_adapters=args.num_adapters,
                           lora_rank=args.lora_rank)
    hf_config = base.llm_engine.core.hf_config
    runs: dict[str, Any] = {"base": [], "lora": []}
    with tempfile.TemporaryDirectory(prefix="pagedlm-lora-bench-") as tmp:
        loras = []
        for i in range(args.num_adapters):
            path = Path(tmp) / f"adapter-{i}"
            write_random_adapter(path, hf_config, args.lora_rank, args.seed + i)
            loras.append(LoRARequest(f"adapter-{i}", i + 1, str(path)))
        llm = LLM(**kwargs, enable_lora=True, max_loras=args.num_adapters,
                  max_lora_rank=args.lora_rank)
        engine = llm.llm_engine
        add_ms = []
        for lora in loras:
            start = time.perf_counter()
            engine.add_lora(lora)
            add_ms.append((time.perf_counter() - start) * 1e3)
        slots = engine.model_executor.driver_worker.model_runner.lora
        read_ms, write_ms = [], []
        for _ in range(args.load_repeats):
            start = time.perf_counter()
            adapter = load_adapter(loras[0], args.lora_rank)
            read_ms.append((time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            slots.load(0, adapter)
            write_ms.append((time.perf_counter() - start) * 1e3)
        spread = [loras[i % len(loras)] for i in range(len(requests))]
        # Base and LoRA runs alternate, so that a machine speeding up or slowing down
        # favours neither; the ratio of each pair is reported, and their median.
        for i in range(args.pairs):
            runs["base"].append(run_pagedlm(base, requests, use_tqdm=False))
            runs["lora"].append(run_pagedlm(llm, requests, use_tqdm=False,
                                            lora_requests=spread))
            print(f"pair {i + 1}: base {runs['base'][-1]['output_tokens_per_s']:.1f}, "
                  f"lora {runs['lora'][-1]['output_tokens_per_s']:.1f} output tok/s")
    ratios = [lo["output_tokens_per_s"] / b["output_tokens_per_s"]
              for b, lo in zip(runs["base"], runs["lora"])]
    runs["ratios_lora_over_base"] = ratios
    runs["ratio_lora_over_base"] = statistics.median(ratios)
    report["throughput"] = runs
    report["adapter_load"] = {
        "adapter_mib": adapter.num_bytes / 2**20,
        "add_ms_each": add_ms,
        "read_ms_median": statistics.median(read_ms),
        "slot_write_ms_median": statistics.median(write_ms),
    }
    print(f"lora ({args.num_adapters} adapters of rank {args.lora_rank}, requests spread over "
          f"them) / the base model alone: median {runs['ratio_lora_over_base']:.3f}x "
          f"(pairs: {', '.join(f'{r:.3f}' for r in ratios)})")
    print(f"adding an adapter ({adapter.num_bytes / 2**20:.1f} MiB): "
          f"{statistics.median(add_ms):.0f} ms (read {statistics.median(read_ms):.0f} ms, "
          f"then checked against the model); writing it into a slot: "
          f"{statistics.median(write_ms):.0f} ms")
    if args.output_json:
        write_json(args.output_json, report)
    return 0
