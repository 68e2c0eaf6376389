"""run_all.py's quick phases on the GPU: greedy-token correctness and the hardware micro
measurements (matmul rate, copy bandwidth), plus the model directory every run loads."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_model_dir(root: Path, cfg: dict[str, Any]) -> str:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    return str(root)


def _cuda_time(fn, iters: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters  # seconds per call


def measure_micro() -> dict[str, float]:
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = _cuda_time(lambda: torch.mm(a, b), 20)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    tc = _cuda_time(lambda: dst.copy_(src), 20)
    # A copy reads and writes every byte: count both, as decode's weight reads are.
    return {"matmul_tflops": 2 * n**3 / t / 1e12, "copy_gbps": 2 * src.numel() / tc / 1e9}


def check_correctness(tmp: Path) -> dict[str, bool]:
    """Greedy tokens: CUDA (Triton, graphs on and off) vs the CPU torch path and HF."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedlm import LLM, SamplingParams
    from pagedlm.layers.triton_ops import ENV as LAYER_OPS_ENV

    torch.manual_seed(0)
    tiny_cfg = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    initializer_range=0.08, tie_word_embeddings=False)
    tiny = tmp / "tiny"
    hf = LlamaForCausalLM(LlamaConfig(**tiny_cfg)).eval()
    hf.save_pretrained(tiny, safe_serialization=True)
    prompts = [[(5 * i + j) % 500 + 1 for j in range(n)] for i, n in enumerate([3, 11, 24, 7])]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def greedy(model_dir: str, dtype: str = "float32", **kw: Any) -> list[list[int]]:
        llm = LLM(model_dir, skip_tokenizer_init=True, dtype=dtype, block_size=4,
                  kv_cache_memory=1 << 24, max_model_len=256, max_num_seqs=8, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    hf = hf.cuda()
    hf_tokens = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p], device="cuda"), do_sample=False,
                              max_new_tokens=16, min_new_tokens=16, pad_token_id=0)
            hf_tokens.append(out[0, len(p):].tolist())
    cpu_ref = greedy(str(tiny), device="cpu", attention_backend="torch")
    res = {"tiny HF model: CPU torch path == HF transformers (CUDA)": cpu_ref == hf_tokens}
    for eager in (True, False):
        mode = "eager" if eager else "CUDA graphs"
        got = greedy(str(tiny), device="cuda", attention_backend="triton", enforce_eager=eager)
        res[f"tiny HF model: CUDA triton, {mode} == CPU torch path"] = got == cpu_ref
        res[f"tiny HF model: CUDA triton, {mode} == HF transformers"] = got == hf_tokens
    # One rank in a worker process of its own (the multiprocess executor, NCCL): what a
    # one-GPU machine can check of tensor parallelism's path.
    got = greedy(str(tiny), device="cuda", attention_backend="triton",
                 distributed_executor_backend="mp")
    res["tiny HF model: CUDA triton, CUDA graphs, rank in a worker process (NCCL) == in process"] = (
        got == greedy(str(tiny), device="cuda", attention_backend="triton"))
    # Dummy weights are drawn per device, so the CUDA runs are compared with each other
    # and with the torch backend on the same device.
    dummy = write_model_dir(tmp / "dummy", {**tiny_cfg, "architectures": ["LlamaForCausalLM"],
                                            "model_type": "llama"})
    ref = greedy(dummy, device="cuda", attention_backend="torch", load_format="dummy")
    for eager in (True, False):
        mode = "eager" if eager else "CUDA graphs"
        got = greedy(dummy, device="cuda", attention_backend="triton", load_format="dummy",
                     enforce_eager=eager)
        res[f"dummy weights: CUDA triton, {mode} == CUDA torch path"] = got == ref
    # The element-wise layers' Triton kernels (layers/triton_ops.py, off by default).
    bf16 = greedy(dummy, dtype="bfloat16", device="cuda", attention_backend="triton",
                  load_format="dummy")
    before = os.environ.get(LAYER_OPS_ENV)
    os.environ[LAYER_OPS_ENV] = "1"
    try:
        got = greedy(str(tiny), device="cuda", attention_backend="triton")
        res["tiny HF model: CUDA triton, CUDA graphs, Triton layer ops == HF transformers"] = (
            got == hf_tokens)
        got = greedy(dummy, dtype="bfloat16", device="cuda", attention_backend="triton",
                     load_format="dummy")
        res["dummy weights, bf16: CUDA graphs, Triton layer ops == torch layer ops"] = got == bf16
    finally:
        if before is None:
            os.environ.pop(LAYER_OPS_ENV, None)
        else:
            os.environ[LAYER_OPS_ENV] = before
    return res
