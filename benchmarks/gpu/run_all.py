"""Every GPU check and measurement of pagedlm in one command (see README.md).

    python benchmarks/gpu/run_all.py [--phases tests,correctness,micro,decode,throughput]

Heavy runs (each 8B engine or HF model) go to a child process of this script, so each
starts with an empty GPU. Results are merged into benchmarks/results/gpu/results.json
(so phases may be split over several calls) and rendered to results.md. Without CUDA
the script says so and exits 0 having measured nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PHASES = ("correctness", "micro", "tests", "decode", "throughput")
THROUGHPUT_RUNS = ("pagedlm_graphs", "hf_cb", "hf_static", "pagedlm_eager")
# Where the heavy runs (decode, throughput) put the model; tests/test_gpu_script.py runs
# them on "cpu" with a tiny configuration to keep them working between GPU loans.
DEVICE = "cuda"
REPO = Path(__file__).resolve().parents[2]

# Llama-3-8B's architecture; weights are dummy (load_format="dummy").
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
    max_position_embeddings=8192, hidden_act="silu", tie_word_embeddings=False,
    bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--phases", default=",".join(PHASES),
                   help="comma-separated subset of " + ",".join(PHASES) + ", run in the "
                        "order given")
    p.add_argument("--throughput-runs", default=",".join(THROUGHPUT_RUNS),
                   help="the throughput phase's engines, in order: a subset of "
                        + ",".join(THROUGHPUT_RUNS))
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results" / "gpu"))
    p.add_argument("--num-prompts", type=int, default=1000, help="ShareGPT requests")
    p.add_argument("--hf-max-batch-size", type=int, default=64, help="HF static batch size")
    p.add_argument("--decode-tokens", type=int, default=256, help="batch-1 tokens timed")
    p.add_argument("--requests-file", default=None,
                   help="ShareGPT requests as token ids, written by --prepare-requests (a GPU "
                        "machine without the dataset or the tokenizer reads them from here)")
    p.add_argument("--prepare-requests", default=None, metavar="PATH",
                   help="write --num-prompts ShareGPT requests as token ids to PATH and exit "
                        "(no GPU needed)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget of the whole run: a heavy run that would start "
                        "with under a minute left is skipped, one that runs past it is "
                        "stopped, and every finished figure is already written")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-arg", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.phases = [x for x in args.phases.split(",") if x]
    unknown = sorted(set(args.phases) - set(PHASES))
    if unknown:
        p.error(f"unknown phase(s) {unknown}; choose from {list(PHASES)}")
    args.throughput_runs = [x for x in args.throughput_runs.split(",") if x]
    unknown = sorted(set(args.throughput_runs) - set(THROUGHPUT_RUNS))
    if unknown:
        p.error(f"unknown throughput run(s) {unknown}; choose from {list(THROUGHPUT_RUNS)}")
    if args.num_prompts < 1 or args.hf_max_batch_size < 1 or args.decode_tokens < 1:
        p.error("--num-prompts, --hf-max-batch-size and --decode-tokens must be >= 1")
    if args.budget_s is not None and args.budget_s <= 0:
        p.error("--budget-s must be > 0")
    return args


# --- derived figures and the report (pure: unit-tested on CPU) ------------------------------


def llama_num_params(cfg: dict[str, Any]) -> int:
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv_dim = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    per_layer = 2 * h * h + 2 * h * kv_dim + 3 * h * inter + 2 * h  # q,o; k,v; mlp; norms
    embed = v * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return cfg["num_hidden_layers"] * per_layer + embed + h


def summarize(m: dict[str, Any], cfg: dict[str, Any] = LLAMA3_8B) -> dict[str, Any]:
    """Ratios against the hardware: decode vs the bandwidth floor, throughput vs compute."""
    params = llama_num_params(cfg)
    s: dict[str, Any] = {"params": params, "weight_bytes": 2 * params}
    if "copy_gbps" in m:
        s["decode_floor_ms"] = s["weight_bytes"] / (m["copy_gbps"] * 1e9) * 1e3
        for mode in ("graphs", "eager"):
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
    for mode in ("graphs", "eager"):
        ms = m.get(f"decode_ms_per_token_{mode}")
        lines.append(f"| batch-1 decode, {mode} | {_fmt(ms)} ms/token "
                     f"({_fmt(s.get(f'decode_{mode}_vs_floor'))} x floor) |")
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


# --- GPU measurements --------------------------------------------------------------------------


def write_model_dir(root: Path, cfg: dict[str, Any]) -> str:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    return str(root)


def smollm2_tokenizer() -> str:
    from pagedlm.loader.default_model import default_model_path

    return default_model_path()  # fetched on first use, as pagedlm's own default model is


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


def _llm_kwargs(model_dir: str, eager: bool) -> dict[str, Any]:
    return dict(model=model_dir, load_format="dummy", dtype="bfloat16", device=DEVICE,
                attention_backend="triton" if DEVICE == "cuda" else "torch", enforce_eager=eager, max_model_len=4096)


def child_decode(model_dir: str, eager: bool, num_tokens: int) -> dict[str, float]:
    from pagedlm import LLM, SamplingParams

    llm = LLM(skip_tokenizer_init=True, max_num_seqs=8, **_llm_kwargs(model_dir, eager))
    prompt = {"prompt_token_ids": list(range(1, 33))}

    def run(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - t0

    run(num_tokens)  # warm-up
    # The difference cancels the prefill and the first token.
    per_token = (run(num_tokens + 1) - run(1)) / num_tokens
    return {"ms_per_token": per_token * 1e3}


def prepare_requests(num_prompts: int, path: str | Path) -> int:
    """Sample ShareGPT requests, counted with SmolLM2's tokenizer, and write them as token
    ids: the same prompts for every engine, and no tokenizer or dataset on the GPU side."""
    from pagedlm.benchmarks.cli import build_requests
    from pagedlm.loader.model_loader import load_tokenizer_for, resolve_model_source

    gguf = smollm2_tokenizer()
    tokenizer = load_tokenizer_for(resolve_model_source(gguf), gguf)
    ns = argparse.Namespace(dataset="sharegpt", num_prompts=num_prompts, seed=0,
                            dataset_path=None, sharegpt_output_len=None)
    rows = []
    for r in build_requests(ns, tokenizer, LLAMA3_8B["vocab_size"]):
        ids = r.prompt_token_ids or tokenizer(r.prompt).input_ids
        rows.append({"prompt_token_ids": list(ids), "output_len": r.output_len})
    Path(path).write_text(json.dumps({"dataset": "sharegpt", "seed": 0,
                                      "tokenizer": os.path.basename(gguf), "requests": rows}))
    return len(rows)


def _sharegpt_requests(num_prompts: int, requests_file: str | None):
    from pagedlm.benchmarks.datasets import SampleRequest

    if requests_file is None:
        requests_file = os.path.join(tempfile.mkdtemp(), "requests.json")
        prepare_requests(num_prompts, requests_file)
    rows = json.loads(Path(requests_file).read_text())["requests"]
    if len(rows) < num_prompts:
        raise SystemExit(f"{requests_file} holds {len(rows)} requests, fewer than "
                         f"--num-prompts {num_prompts}")
    return [SampleRequest(prompt="", prompt_len=len(r["prompt_token_ids"]),
                          output_len=r["output_len"],
                          prompt_token_ids=tuple(r["prompt_token_ids"]))
            for r in rows[:num_prompts]]


def child_throughput(model_dir: str, which: str, num_prompts: int, hf_bs: int,
                     requests_file: str | None) -> dict:
    import torch

    requests = _sharegpt_requests(num_prompts, requests_file)
    if which.startswith("pagedlm"):
        from pagedlm import LLM
        from pagedlm.benchmarks.throughput import run_pagedlm

        llm = LLM(skip_tokenizer_init=True, max_num_seqs=256,
                  **_llm_kwargs(model_dir, eager=which.endswith("eager")))
        return run_pagedlm(llm, requests, ignore_eos=True, use_tqdm=False)
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), dtype=torch.bfloat16).eval()
    prompt_tokens = sum(r.prompt_len for r in requests)
    if which == "hf_static":
        from pagedlm.benchmarks.hf_baseline import run_hf_static
        from pagedlm.benchmarks.throughput import PretokenizedPrompts

        tok = _OnDevice(PretokenizedPrompts(requests, cfg["eos_token_id"]))
        reqs = tok.requests(requests)
        with torch.inference_mode():
            return run_hf_static(model, tok, reqs, max_batch_size=hf_bs, num_threads=None,
                                 use_tqdm=False)
    from pagedlm.benchmarks.throughput import throughput_figures

    gen = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0,
                           max_new_tokens=max(r.output_len for r in requests),
                           eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    start = time.perf_counter()
    for i, r in enumerate(requests):
        manager.add_request(r.prompt_token_ids, request_id=str(i), max_new_tokens=r.output_len)
    generated = 0
    for _ in requests:
        result = manager.get_result(timeout=600)
        generated += len(result.generated_tokens)
    elapsed = time.perf_counter() - start
    manager.stop(block=True)
    return throughput_figures(elapsed, len(requests), prompt_tokens, generated)


class _OnDevice:
    """A tokenizer whose encodings land on DEVICE (the HF baseline encodes on the host)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_inner":
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)

    def __call__(self, *a: Any, **kw: Any) -> dict:
        return {k: v.to(DEVICE) for k, v in self._inner(*a, **kw).items()}


def check_correctness(tmp: Path) -> dict[str, bool]:
    """Greedy tokens: CUDA (Triton, graphs on and off) vs the CPU torch path and HF."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedlm import LLM, SamplingParams

    torch.manual_seed(0)
    tiny_cfg = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    initializer_range=0.08, tie_word_embeddings=False)
    tiny = tmp / "tiny"
    hf = LlamaForCausalLM(LlamaConfig(**tiny_cfg)).eval()
    hf.save_pretrained(tiny, safe_serialization=True)
    prompts = [[(5 * i + j) % 500 + 1 for j in range(n)] for i, n in enumerate([3, 11, 24, 7])]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def greedy(model_dir: str, **kw: Any) -> list[list[int]]:
        llm = LLM(model_dir, skip_tokenizer_init=True, dtype="float32", block_size=4,
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
    return res


def _run_child(args: argparse.Namespace, child: str, arg: str, model_dir: str,
               deadline: float | None) -> dict:
    """One heavy run in its own process: its figures, or {"error": why} if it failed, was
    skipped or ran out of time."""
    timeout = None
    if deadline is not None:
        timeout = deadline - time.monotonic()
        if timeout < 60:
            return {"error": f"skipped: {timeout:.0f} s of the budget left"}
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, __file__, "--child", child, "--child-arg", arg, "--child-json", path,
           "--num-prompts", str(args.num_prompts), "--hf-max-batch-size",
           str(args.hf_max_batch_size), "--decode-tokens", str(args.decode_tokens),
           "--out-dir", model_dir]
    if args.requests_file is not None:
        cmd += ["--requests-file", str(Path(args.requests_file).resolve())]
    print(f"[run_all] {child} {arg} ...", flush=True)
    t0 = time.monotonic()
    try:
        rc = subprocess.call(cmd, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped at the budget after {time.monotonic() - t0:.0f} s"}
    text = Path(path).read_text()
    result = json.loads(text) if text else {}
    if rc != 0:
        return {"error": result.get("error", f"exit {rc}")}
    print(f"[run_all] {child} {arg} done in {time.monotonic() - t0:.0f} s", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prepare_requests is not None:
        n = prepare_requests(args.num_prompts, args.prepare_requests)
        print(f"wrote {n} ShareGPT requests to {args.prepare_requests}")
        return 0
    import torch

    if args.child is not None:  # one heavy run, in its own process; --out-dir is the model
        try:
            if args.child == "decode":
                result = child_decode(args.out_dir, args.child_arg == "eager",
                                      args.decode_tokens)
            else:
                result = child_throughput(args.out_dir, args.child_arg, args.num_prompts,
                                          args.hf_max_batch_size, args.requests_file)
        except BaseException as e:  # the parent reports why, the traceback goes to the log
            Path(args.child_json).write_text(json.dumps({"error": repr(e)[:1000]}))
            raise
        Path(args.child_json).write_text(json.dumps(result))
        return 0
    if not torch.cuda.is_available():
        print("run_all: CUDA is not available; skipping every GPU check and measurement "
              "(run this on an H100/H200).")
        return 0
    deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    m: dict[str, Any] = {"device": torch.cuda.get_device_name(), "num_prompts": args.num_prompts,
                         "torch": torch.__version__}

    def save(part: dict[str, Any]) -> None:  # every figure is written as soon as it exists
        m.update(part)
        write_results(args.out_dir, part)

    save(dict(m))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = write_model_dir(tmp / "llama3-8b", LLAMA3_8B)

        def phase(name: str, fn) -> None:  # a phase that breaks is recorded, not fatal
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - the report says which phase and why
                print(f"[run_all] phase {name} raised: {e!r}", flush=True)
                save({"errors": {**m.get("errors", {}), name: repr(e)[:2000]}})

        def tests() -> None:
            cmd = [sys.executable, "-m", "pytest", "-q", "tests/test_triton_attention.py",
                   "tests/test_cuda_graphs.py"]
            # At most a third of the budget: the measurements after it must still run.
            left = None if deadline is None else max(60.0, (deadline - time.monotonic()) / 3)
            try:
                proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                                      timeout=left)
                out, err, rc = proc.stdout, proc.stderr, proc.returncode
            except subprocess.TimeoutExpired as e:
                out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                err, rc = f"stopped after {left:.0f} s", -1
                out += f"\nstopped at the budget after {left:.0f} s"
            print(out[-3000:], err[-2000:], flush=True)
            lines = out.strip().splitlines()
            save({"tests": {"command": " ".join(cmd[1:]), "rc": rc,
                            "summary": lines[-1] if lines else ""}})

        def failed(name: str, r: dict) -> bool:
            if "error" not in r:
                return False
            print(f"[run_all] {name}: {r['error']}", flush=True)
            save({"errors": {**m.get("errors", {}), name: r["error"]}})
            return True

        def decode() -> None:
            for mode in ("graphs", "eager"):
                r = _run_child(args, "decode", mode, model_dir, deadline)
                if not failed(f"decode {mode}", r):
                    save({f"decode_ms_per_token_{mode}": r["ms_per_token"]})

        def throughput() -> None:
            # The headline first: a run cut short by the budget loses the least.
            for which in args.throughput_runs:
                r = _run_child(args, "throughput", which, model_dir, deadline)
                if not failed(f"throughput {which}", r):
                    save({"throughput": {which: r}})

        phases = {"correctness": lambda: save({"correctness": check_correctness(tmp)}),
                  "micro": lambda: save(measure_micro()), "tests": tests, "decode": decode,
                  "throughput": throughput}
        for name in args.phases:
            phase(name, phases[name])
    merged = write_results(args.out_dir, {})
    print(render_markdown(merged, summarize(merged)))
    failed = (m.get("tests", {}).get("rc", 0) != 0 or "errors" in m
              or not all(m.get("correctness", {}).values()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
