"""The model run_all.py measures, the figures derived from its measurements, and the report.

Pure (no torch, no GPU): tests/test_gpu_script.py checks all of it on CPU. `write_results`
merges each new figure into results.json and rewrites results.md from the merged data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Llama-3-8B's architecture; weights are dummy (load_format="dummy").
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
    max_position_embeddings=8192, hidden_act="silu", tie_word_embeddings=False,
    bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16",
)



def llama_num_params(cfg: dict[str, Any]) -> int:
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv_dim = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    per_layer = 2 * h * h + 2 * h * kv_dim + 3 * h * inter + 2 * h  # q,o; k,v; mlp; norms
    embed = v * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return cfg["num_hidden_layers"] * per_layer + embed + h


# The decode phase's engines: CUDA graphs, eager, and CUDA graphs with the element-wise
# layers' Triton kernels (layers/triton_ops.py, PAGEDLM_TRITON_LAYER_OPS=1).
DECODE_MODES = ("graphs", "eager", "graphs_layer_ops")


def summarize(m: dict[str, Any], cfg: dict[str, Any] = LLAMA3_8B) -> dict[str, Any]:
    """Ratios against the hardware: decode vs the bandwidth floor, throughput vs compute."""
    params = llama_num_params(cfg)
    s: dict[str, Any] = {"params": params, "weight_bytes": 2 * params}
    if "copy_gbps" in m:
        s["decode_floor_ms"] = s["weight_bytes"] / (m["copy_gbps"] * 1e9) * 1e3
        for mode in DECODE_MODES:
            ms = m.get(f"decode_ms_per_token_{mode}")
            if ms is not None:
                s[f"decode_{mode}_vs_floor"] = ms / s["decode_floor_ms"]
    if "matmul_tflops" in m:
        s["ceiling_tokens_per_s"] = m["matmul_tflops"] * 1e12 / (2 * params)
    tp = m.get("throughput", {})
    hf_static = tp.get("hf_static", {}).get("total_tokens_per_s")
    hf_cb = tp.get("hf_cb", {}).get("total_tokens_per_s")
    for name, r in tp.items():
        tps = r.get("total_tokens_per_s")
        if tps is None:
            continue
        row = {"total_tokens_per_s": tps}
        if "ceiling_tokens_per_s" in s:
            row["fraction_of_ceiling"] = tps / s["ceiling_tokens_per_s"]
        if hf_static:
            row["vs_hf_static"] = tps / hf_static
        if hf_cb:
            row["vs_hf_cb"] = tps / hf_cb
        s.setdefault("throughput", {})[name] = row
    return s


def _fmt(x: Any, spec: str = ".3g") -> str:
    return "—" if x is None else (format(x, spec) if isinstance(x, float) else str(x))


def render_markdown(m: dict[str, Any], s: dict[str, Any]) -> str:
    lines = ["# pagedlm on GPU", "", f"Device: {m.get('device', '?')}, torch {m.get('torch', '?')}",
             ""]
    if m.get("errors"):
        lines += ["## Runs that failed", ""]
        lines += [f"- {k}: `{v}`" for k, v in m["errors"].items()]
        lines.append("")
    if "tests" in m:
        lines += ["## Tests", "", f"`{m['tests']['command']}`: exit {m['tests']['rc']} — "
                  f"{m['tests']['summary']}", ""]
    if "correctness" in m:
        lines += ["## Greedy outputs", "", "| check | equal |", "|---|---|"]
        lines += [f"| {k} | {'yes' if v else '**NO**'} |" for k, v in m["correctness"].items()]
        lines.append("")
    lines += ["## Hardware and decode (Llama-3-8B architecture, dummy bf16 weights)", "",
              "| figure | value |", "|---|---|",
              f"| parameters | {s['params'] / 1e9:.2f} B |",
              f"| bf16 matmul | {_fmt(m.get('matmul_tflops'))} TFLOP/s |",
              f"| device copy bandwidth | {_fmt(m.get('copy_gbps'))} GB/s |",
              f"| decode floor (weights / bandwidth) | {_fmt(s.get('decode_floor_ms'))} ms |"]
    for mode in DECODE_MODES:
        ms = m.get(f"decode_ms_per_token_{mode}")
        if ms is None and mode not in ("graphs", "eager"):
            continue  # a mode this run did not measure
        runs = m.get(f"decode_ms_per_token_{mode}_runs")
        each = f"; median of {', '.join(_fmt(x) for x in runs)}" if runs else ""
        lines.append(f"| batch-1 decode, {mode} | {_fmt(ms)} ms/token "
                     f"({_fmt(s.get(f'decode_{mode}_vs_floor'))} x floor{each}) |")
    lines.append(f"| compute ceiling (2 x params FLOPs/token) | "
                 f"{_fmt(s.get('ceiling_tokens_per_s'))} tokens/s |")
    if s.get("throughput"):
        lines += ["", f"## Throughput, {m.get('num_prompts', '?')} ShareGPT requests", "",
                  "| run | total tokens/s | vs HF static | vs HF continuous | of ceiling |",
                  "|---|---|---|---|---|"]
        for name, r in s["throughput"].items():
            lines.append(f"| {name} | {r['total_tokens_per_s']:.1f} | "
                         f"{_fmt(r.get('vs_hf_static'), '.2f')} | "
                         f"{_fmt(r.get('vs_hf_cb'), '.2f')} | "
                         f"{_fmt(r.get('fraction_of_ceiling'), '.1%')} |")
    return "\n".join(lines) + "\n"


def write_results(out_dir: str | Path, m: dict[str, Any]) -> dict[str, Any]:
    """Merge `m` into out_dir/results.json, rewrite results.md; returns the merged data."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    for k, v in m.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = {**merged[k], **v}
        else:
            merged[k] = v
    summary = summarize(merged)
    path.write_text(json.dumps({**merged, "summary": summary}, indent=2) + "\n")
    (out / "results.md").write_text(render_markdown(merged, summary))
    return merged
