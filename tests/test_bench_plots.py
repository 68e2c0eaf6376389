"""`pagedlm bench plot` writes PNGs from result JSONs (synthetic ones: no model is run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedlm.benchmarks.common import read_json, write_json
from pagedlm.benchmarks.kv_usage import measured_waste, simulate_kv_usage
from pagedlm.benchmarks.metrics import RequestRecord, compute_serving_metrics
from pagedlm.engine.stats import KVUsageSample
from pagedlm.entrypoints.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC


def throughput_json(path: Path, label: str, tokens_per_s: float) -> Path:
    figures = {"requests_per_s": tokens_per_s / 100, "output_tokens_per_s": tokens_per_s,
               "total_tokens_per_s": 3 * tokens_per_s}
    return write_json(path, {"benchmark": "throughput", "model": "m", "dataset": "random",
                             "machine": {"cpu_model": "cpu", "threads": 2},
                             "results": {label: figures}})


def test_plot_throughput_bars(tmp_path: Path) -> None:
    a = throughput_json(tmp_path / "a.json", "pagedlm", 120.0)
    b = throughput_json(tmp_path / "b.json", "hf", 40.0)
    out = tmp_path / "plots" / "x.png"
    assert main(["bench", "plot", "throughput", str(a), str(b), "-o", str(out)]) == 0
    assert is_png(out)
    # Without -o the PNG goes next to the first JSON; equal labels get the file's name.
    c = throughput_json(tmp_path / "c.json", "pagedlm", 100.0)
    assert main(["bench", "plot", "throughput", str(a), str(c)]) == 0
    assert is_png(tmp_path / "a_throughput.png")


def test_throughput_plot_takes_serving_results(tmp_path: Path) -> None:
    from pagedlm.benchmarks.plots import throughput_runs

    a = throughput_json(tmp_path / "a.json", "pagedlm", 120.0)
    serving = {"benchmark": "serving", "label": "llama-server np=16",
               "results": {"output_throughput": 89.0, "total_token_throughput": 170.0,
                           "request_throughput": 0.44}}
    runs = throughput_runs([("a.json", read_json(a)), ("s.json", serving)])
    assert runs[1] == ("llama-server np=16 (served)", {
        "output_tokens_per_s": 89.0, "total_tokens_per_s": 170.0, "requests_per_s": 0.44})
    s = write_json(tmp_path / "s.json", serving)
    assert main(["bench", "plot", "throughput", str(a), str(s)]) == 0
    assert is_png(tmp_path / "a_throughput.png")
    with pytest.raises(ValueError, match="output_throughput"):
        throughput_runs([("bad.json", {"benchmark": "serving", "results": {}})])


def test_unlabelled_pagedlm_run_names_its_weight_dtype() -> None:
    from pagedlm.benchmarks.plots import throughput_runs

    figures = {"output_tokens_per_s": 1.0, "total_tokens_per_s": 2.0, "requests_per_s": 0.1}
    report = {"benchmark": "throughput", "results": {
        "pagedlm": {**figures, "engine_args": {"weight_dtype": "q8"}},
        "llama-cpp-python": figures,
        "pagedlm float16": {**figures, "engine_args": {"weight_dtype": "float16"}},  # --label
    }}
    assert [label for label, _ in throughput_runs([("r.json", report)])] == [
        "pagedlm q8", "llama-cpp-python", "pagedlm float16"]
    report["results"] = {"pagedlm": {**figures, "engine_args": {"weight_dtype": "auto"}}}
    assert [label for label, _ in throughput_runs([("r.json", report)])] == ["pagedlm"]


def test_plot_latency_against_rate(tmp_path: Path) -> None:
    files = []
    for i, rate in enumerate([1.0, 4.0, float("inf")]):
        records = [RequestRecord(0.0, (0.1 * (i + 1), 0.2 * (i + 1)), 0.3 * (i + 1), 5, 3)]
        files.append(str(write_json(tmp_path / f"s{i}.json", {
            "benchmark": "serving", "label": "tiny", "request_rate": rate,
            "results": compute_serving_metrics(records, 1.0)})))
    assert main(["bench", "plot", "latency", *files]) == 0
    assert is_png(tmp_path / "s0_latency.png")


def test_plot_kv_usage(tmp_path: Path) -> None:
    sim = simulate_kv_usage([(3, 5), (9, 2), (4, 4)], [4, 8], max_model_len=32)
    samples = [KVUsageSample(i, 16, 10 + i, 2) for i in range(1, 5)]
    path = write_json(tmp_path / "kv.json", {
        "benchmark": "kv-waste", "results": {"simulated": sim,
                                             "measured": {"4": measured_waste(samples)}}})
    out = tmp_path / "kv.png"
    assert main(["bench", "plot", "kv-usage", str(path), "-o", str(out)]) == 0
    assert is_png(out)


def test_plot_refuses_the_wrong_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a = throughput_json(tmp_path / "a.json", "pagedlm", 1.0)
    assert main(["bench", "plot", "latency", str(a)]) == 2
    assert "not a `pagedlm bench serving` result" in capsys.readouterr().err
    assert main(["bench", "plot", "throughput", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
