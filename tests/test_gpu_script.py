"""benchmarks/gpu/run_all.py on CPU: argument parsing, derived figures, the report."""

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "run_all.py"
_spec = importlib.util.spec_from_file_location("gpu_run_all", _PATH)
run_all = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_all)


def test_parse_args():
    args = run_all.parse_args(["--phases", "micro,decode", "--num-prompts", "10"])
    assert args.phases == ["micro", "decode"] and args.num_prompts == 10
    assert run_all.parse_args([]).phases == list(run_all.PHASES)
    args = run_all.parse_args(["--phases", "throughput,decode", "--throughput-runs", "hf_cb"])
    assert args.phases == ["throughput", "decode"] and args.throughput_runs == ["hf_cb"]
    with pytest.raises(SystemExit):
        run_all.parse_args(["--throughput-runs", "vllm"])
    with pytest.raises(SystemExit):
        run_all.parse_args(["--phases", "micro,bogus"])
    with pytest.raises(SystemExit):
        run_all.parse_args(["--num-prompts", "0"])


def test_llama3_8b_params():
    assert run_all.llama_num_params(run_all.LLAMA3_8B) == 8_030_261_248


FAKE = {
    "device": "NVIDIA H100 80GB HBM3", "num_prompts": 1000,
    "tests": {"command": "pytest -q tests/x.py", "rc": 0, "summary": "5 passed"},
    "correctness": {"graphs == eager": True, "cpu == hf": False},
    "matmul_tflops": 700.0, "copy_gbps": 3000.0,
    "decode_ms_per_token_graphs": 6.0, "decode_ms_per_token_eager": 12.0,
    "decode_ms_per_token_graphs_runs": [6.5, 6.0, 5.9],
    "throughput": {"pagedlm_graphs": {"total_tokens_per_s": 9000.0},
                   "hf_static": {"total_tokens_per_s": 1500.0},
                   "hf_cb": {"total_tokens_per_s": 3000.0}},
}


def test_summary_ratios():
    s = run_all.summarize(FAKE)
    floor_ms = 2 * 8_030_261_248 / 3e12 * 1e3
    assert s["decode_floor_ms"] == pytest.approx(floor_ms)
    assert s["decode_graphs_vs_floor"] == pytest.approx(6.0 / floor_ms)
    assert s["ceiling_tokens_per_s"] == pytest.approx(700e12 / (2 * 8_030_261_248))
    row = s["throughput"]["pagedlm_graphs"]
    assert row["vs_hf_static"] == pytest.approx(6.0) and row["vs_hf_cb"] == pytest.approx(3.0)
    assert row["fraction_of_ceiling"] == pytest.approx(9000.0 / s["ceiling_tokens_per_s"])
    assert "decode_floor_ms" not in run_all.summarize({})


def test_write_results_merges_and_renders(tmp_path):
    first = {k: v for k, v in FAKE.items() if k != "throughput"}
    run_all.write_results(tmp_path, first)
    merged = run_all.write_results(tmp_path, {"throughput": FAKE["throughput"]})
    assert merged["matmul_tflops"] == 700.0 and "hf_cb" in merged["throughput"]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["summary"]["throughput"]["hf_static"]["vs_hf_static"] == 1.0
    md = (tmp_path / "results.md").read_text()
    assert "| pagedlm_graphs | 9000.0 | 6.00 | 3.00 |" in md
    assert "| cpu == hf | **NO** |" in md and "5 passed" in md
    assert "ms/token" in md and "8.03 B" in md
    assert "| batch-1 decode, graphs | 6 ms/token (" in md and "median of 6.5, 6, 5.9) |" in md


def test_main_skips_without_cuda(capsys, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_all.main(["--out-dir", str(tmp_path)]) == 0
    assert "CUDA is not available" in capsys.readouterr().out
    assert not (tmp_path / "results.json").exists()


TINY_LLAMA = {**run_all.LLAMA3_8B, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 300, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
              "max_position_embeddings": 8192}


def _requests_file(tmp_path, n=5):
    rows = [{"prompt_token_ids": [(7 * i + j) % 290 + 3 for j in range(4 + 3 * i)],
             "output_len": 3 + i} for i in range(n)]
    path = tmp_path / "requests.json"
    path.write_text(json.dumps({"dataset": "sharegpt", "requests": rows}))
    return str(path), rows


@pytest.mark.parametrize("which", ["pagedlm_eager", "pagedlm_graphs_mp", "hf_static", "hf_cb"])
def test_heavy_runs_work_on_cpu(tmp_path, monkeypatch, which):
    """The GPU machine is lent rarely and briefly: each heavy run (the same code, a tiny
    model, DEVICE='cpu') must already work here, reading prepared requests as token ids."""
    monkeypatch.setattr(run_all, "DEVICE", "cpu")
    model_dir = run_all.write_model_dir(tmp_path / "tiny", TINY_LLAMA)
    path, rows = _requests_file(tmp_path)
    r = run_all.child_throughput(model_dir, which, len(rows), 2, path)
    assert r["num_requests"] == len(rows)
    assert r["prompt_tokens"] == sum(len(x["prompt_token_ids"]) for x in rows)
    assert r["output_tokens"] == sum(x["output_len"] for x in rows)
    assert r["total_tokens_per_s"] > 0


def test_decode_run_works_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(run_all, "DEVICE", "cpu")
    model_dir = run_all.write_model_dir(tmp_path / "tiny", TINY_LLAMA)
    r = run_all.child_decode(model_dir, eager=True, num_tokens=4, repeats=3)
    assert len(r["ms_per_token_runs"]) == 3 and all(x > 0 for x in r["ms_per_token_runs"])
    assert r["ms_per_token"] == sorted(r["ms_per_token_runs"])[1]


def test_requests_file_shorter_than_asked_is_refused(tmp_path):
    path, rows = _requests_file(tmp_path, n=2)
    with pytest.raises(SystemExit, match="holds 2 requests"):
        run_all._sharegpt_requests(3, path)
    got = run_all._sharegpt_requests(2, path)
    assert [list(r.prompt_token_ids) for r in got] == [x["prompt_token_ids"] for x in rows]
    assert [r.prompt_len for r in got] == [len(x["prompt_token_ids"]) for x in rows]


def test_a_failed_or_skipped_run_says_why(tmp_path):
    args = run_all.parse_args(["--num-prompts", "1"])
    missing = str(tmp_path / "no-such-model")
    r = run_all._run_child(args, "decode", "eager", missing, deadline=None)
    assert "error" in r and "no-such-model" in r["error"]
    import time

    r = run_all._run_child(args, "decode", "eager", missing, deadline=time.monotonic() + 5)
    assert r == {"error": "skipped: 5 s of the budget left"}
    run_all.write_results(tmp_path, {"errors": {"decode eager": r["error"]}})
    assert "- decode eager: `skipped" in (tmp_path / "results.md").read_text()


def test_decode_profiler_works_on_cpu(tmp_path, monkeypatch):
    """benchmarks/gpu/profile_decode.py, with the tiny model on CPU: it writes the profile
    with its per-step figures, the kernel/operator tables and the host-side cProfile."""
    path = _PATH.with_name("profile_decode.py")
    spec = importlib.util.spec_from_file_location("gpu_profile_decode", path)
    prof = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prof)
    monkeypatch.setattr(prof.run_all, "DEVICE", "cpu")
    monkeypatch.setattr(prof.run_all, "LLAMA3_8B", TINY_LLAMA)
    assert prof.main(["--out-dir", str(tmp_path), "--eager", "--tokens", "4"]) == 0
    text = (tmp_path / "profile_decode_eager.txt").read_text()
    assert "mode eager, batch 1, 4 tokens per request" in text
    assert "wall per step:" in text and "execute_model" in text
    assert str(_PATH.parents[2]) not in text  # paths are relative to the repository


def test_the_layer_ops_decode_row_appears_only_when_measured(tmp_path):
    """The decode phase's third engine (CUDA graphs with the Triton layer kernels) gets its
    ratio to the floor and its own row; a run without it shows no empty row for it."""
    run_all.write_results(tmp_path / "without", dict(FAKE))
    assert "graphs_layer_ops" not in (tmp_path / "without" / "results.md").read_text()
    run_all.write_results(tmp_path / "with", {**FAKE, "decode_ms_per_token_graphs_layer_ops": 4.5})
    summary = json.loads((tmp_path / "with" / "results.json").read_text())["summary"]
    floor_ms = 2 * 8_030_261_248 / 3e12 * 1e3
    assert summary["decode_graphs_layer_ops_vs_floor"] == pytest.approx(4.5 / floor_ms)
    assert "| batch-1 decode, graphs_layer_ops | 4.5 ms/token (" in (
        tmp_path / "with" / "results.md").read_text()
