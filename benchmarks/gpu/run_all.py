"""Every GPU check and measurement of pagedlm in one command (see README.md).

    python benchmarks/gpu/run_all.py [--phases tests,correctness,micro,decode,throughput]

Heavy runs (each 8B engine or HF model) go to a child process of this script, so each
starts with an empty GPU. Results are merged into benchmarks/results/gpu/results.json
(so phases may be split over several calls) and rendered to results.md. Without CUDA
the script says so and exits 0 having measured nothing.

This file is the command, the heavy runs and their child processes; next to it are the
quick GPU phases (gpu_checks.py), the HF baselines (hf_runs.py) and the model measured
with the figures and report derived from it (gpu_report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PHASES = ("correctness", "micro", "tests", "decode", "throughput")
# pagedlm_graphs_mp: the same engine with its one rank in a worker process of its own
# (the multiprocess executor, NCCL with one rank): the cost of the engine/worker boundary.
THROUGHPUT_RUNS = ("pagedlm_graphs", "hf_cb", "hf_static", "pagedlm_eager", "pagedlm_graphs_mp")
# Where the heavy runs (decode, throughput) put the model; tests/test_gpu_script.py runs
# them on "cpu" with a tiny configuration to keep them working between GPU loans.
DEVICE = "cuda"
REPO = Path(__file__).resolve().parents[2]

# The script's parts, next to it (run as a script, or loaded from its path by the tests).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_checks import check_correctness, measure_micro, write_model_dir  # noqa: E402
from gpu_report import (  # noqa: E402
    DECODE_MODES,
    LLAMA3_8B,
    llama_num_params,  # noqa: F401 - tests/test_gpu_script.py reads it as run_all.*
    render_markdown,
    summarize,
    write_results,
)
from hf_runs import hf_cb_throughput, hf_static_throughput  # noqa: E402


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


# --- the heavy runs: each in a child process of its own, the model on DEVICE ---------------


def smollm2_tokenizer() -> str:
    from pagedlm.loader.default_model import default_model_path

    return default_model_path()  # fetched on first use, as pagedlm's own default model is


def _llm_kwargs(model_dir: str, eager: bool) -> dict[str, Any]:
    return dict(model=model_dir, load_format="dummy", dtype="bfloat16", device=DEVICE,
                attention_backend="triton" if DEVICE == "cuda" else "torch", enforce_eager=eager, max_model_len=4096)


# Timed decode runs per engine; the figure is their median. On the fourth loan the first
# engine of a fresh machine measured 12.4 ms/token where a warm one measured 7.2, one
# run each (benchmarks/results/gpu/RUNS.md): the runs show whether a figure held still.
DECODE_REPEATS = 3


def child_decode(model_dir: str, eager: bool, num_tokens: int,
                 repeats: int = DECODE_REPEATS) -> dict[str, Any]:
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
    runs = [(run(num_tokens + 1) - run(1)) / num_tokens * 1e3 for _ in range(repeats)]
    return {"ms_per_token": statistics.median(runs), "ms_per_token_runs": runs}


def prepare_requests(num_prompts: int, path: str | Path) -> int:
    """Sample ShareGPT requests, counted with SmolLM2's tokenizer, and write them as token
    ids: the same prompts for every engine, and no tokenizer or dataset on the GPU side."""
    from pagedlm.benchmarks.dataset_args import build_requests
    from pagedlm.loader.model_loader import resolve_model_source
    from pagedlm.loader.tokenizer import load_tokenizer_for

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

        backend = "mp" if which.endswith("_mp") else None
        llm = LLM(skip_tokenizer_init=True, max_num_seqs=256, distributed_executor_backend=backend,
                  **_llm_kwargs(model_dir, eager=which.endswith("eager")))
        return run_pagedlm(llm, requests, ignore_eos=True, use_tqdm=False)
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), dtype=torch.bfloat16).eval()
    if which == "hf_static":
        return hf_static_throughput(model, requests, cfg["eos_token_id"], hf_bs, DEVICE)
    return hf_cb_throughput(model, requests)


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
                if args.child_arg == "graphs_layer_ops":
                    from pagedlm.layers.triton_ops import ENV as LAYER_OPS_ENV

                    os.environ[LAYER_OPS_ENV] = "1"
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
            for mode in DECODE_MODES:
                r = _run_child(args, "decode", mode, model_dir, deadline)
                if not failed(f"decode {mode}", r):
                    save({f"decode_ms_per_token_{mode}": r["ms_per_token"],
                          f"decode_ms_per_token_{mode}_runs": r["ms_per_token_runs"]})

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
