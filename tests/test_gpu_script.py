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


def test_main_skips_without_cuda(capsys, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_all.main(["--out-dir", str(tmp_path)]) == 0
    assert "CUDA is not available" in capsys.readouterr().out
    assert not (tmp_path / "results.json").exists()
