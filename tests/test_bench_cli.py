"""`pagedlm bench throughput / latency / kv-waste` end to end on a tiny random Llama.

The tiny model (vocab 512, hidden 64, 2 layers) has no tokenizer: the random and prefix
datasets hand the engine token ids, so none is needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedlm.entrypoints.cli import main
from tests.conftest import requires_smollm2

TINY_FLAGS = ["--skip-tokenizer-init", "--kv-cache-memory", "8M", "--num-threads", "1"]


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def check_header(report: dict, benchmark: str, dataset: str, num_prompts: int) -> None:
    assert report["benchmark"] == benchmark
    assert report["dataset"] == dataset
    assert report["num_prompts"] == num_prompts
    assert report["seed"] == 0
    assert report["dtype"] in ("float32", None)
    assert {"cpu_model", "cpu_cores", "usable_cores", "threads"} <= set(report["machine"])
    assert set(report["versions"]) == {"pagedlm", "torch", "transformers", "llama-cpp-python"}
    assert report["versions"]["torch"]


def test_throughput_pagedlm_random(tiny_llama_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    rc = main(["bench", "throughput", tiny_llama_dir, *TINY_FLAGS, "--dataset", "random",
               "--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "8",
               "--disable-tqdm", "--output-json", str(out)])
    assert rc == 0
    report = read(out)
    check_header(report, "throughput", "random", 4)
    assert report["model"] == tiny_llama_dir and report["backends"] == ["pagedlm"]
    assert report["ignore_eos"] is True
    r = report["results"]["pagedlm"]
    assert r["num_requests"] == 4
    assert r["prompt_tokens"] == 64 and r["output_tokens"] == 32
    assert r["requests_per_s"] > 0 and r["output_tokens_per_s"] > 0
    assert r["total_tokens_per_s"] == pytest.approx(r["output_tokens_per_s"] * 3)


def test_throughput_hf_sweep_on_prefix_dataset(tiny_llama_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "hf.json"
    rc = main(["bench", "throughput", tiny_llama_dir, *TINY_FLAGS, "--backend", "hf",
               "--hf-max-batch-size", "2", "4", "--dataset", "prefix", "--prefix-len", "12",
               "--prefix-suffix-len", "4", "--num-prefixes", "2", "--num-prompts", "4",
               "--random-output-len", "4", "--disable-tqdm", "--output-json", str(out)])
    assert rc == 0
    report = read(out)
    check_header(report, "throughput", "prefix", 4)
    r = report["results"]["hf"]
    assert [s["max_batch_size"] for s in r["sweep"]] == [2, 4]
    best = max(r["sweep"], key=lambda s: s["output_tokens_per_s"])
    assert r["max_batch_size"] == best["max_batch_size"]
    assert r["prompt_tokens"] == 64 and r["output_tokens"] == 16


def test_throughput_sharegpt_without_tokenizer_is_a_clear_error(
        tiny_llama_dir: str, capsys: pytest.CaptureFixture) -> None:
    rc = main(["bench", "throughput", tiny_llama_dir, *TINY_FLAGS, "--num-prompts", "2",
               "--disable-tqdm"])
    assert rc == 2
    assert "drop --skip-tokenizer-init or use --dataset random" in capsys.readouterr().err


def test_latency(tiny_llama_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "lat.json"
    rc = main(["bench", "latency", tiny_llama_dir, *TINY_FLAGS, "--batch-size", "2",
               "--input-len", "8", "--output-len", "4", "--num-iters-warmup", "1",
               "--num-iters", "2", "--output-json", str(out)])
    assert rc == 0
    report = read(out)
    check_header(report, "latency", "random", 2)
    r = report["results"]
    assert len(r["latencies_s"]) == 2 and r["latency_s"]["count"] == 2
    assert r["latency_s"]["p50"] > 0 and r["latency_s"]["p99"] >= r["latency_s"]["p50"]
    # Each iteration: one prefill step, then a decode step per remaining token.
    assert r["steps_per_iteration"] == [4, 4]
    assert r["prefill_step_ms"]["count"] == 2 and r["decode_step_ms"]["count"] == 6


def test_kv_waste_with_measurement(tiny_llama_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    rc = main(["bench", "kv-waste", tiny_llama_dir, *TINY_FLAGS, "--dataset", "random",
               "--num-prompts", "6", "--random-input-len", "20", "--random-output-len", "6",
               "--random-range-ratio", "0.5", "--max-model-len", "128", "--block-sizes", "4",
               "16", "--measure", "--measure-num-prompts", "3", "--output-json", str(out)])
    assert rc == 0
    report = read(out)
    check_header(report, "kv-waste", "random", 6)
    res = report["results"]
    assert res["simulated"]["num_requests"] == 6
    assert set(res["measured"]) == {"4", "16"}
    for bs in ("4", "16"):
        measured = res["measured"][bs]["waste"]
        simulated = res["simulated_measured_requests"]["waste"][f"paged_bs{bs}"]
        assert 0 <= measured < 1
        assert measured == pytest.approx(simulated, abs=0.05)
    assert main(["bench", "plot", "kv-usage", str(out)]) == 0
    assert (tmp_path / "kv_kv_usage.png").is_file()


def test_kv_waste_refuses_block_size(tiny_llama_dir: str,
                                     capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "kv-waste", tiny_llama_dir, "--block-size", "16"]) == 2
    assert "--block-sizes" in capsys.readouterr().err


@requires_smollm2
def test_structured_pairs_on_the_embedded_model(tmp_path: Path) -> None:
    """Constrained and unconstrained runs generate the same tokens per request; every
    constrained output that finished is a document; the ratio is theirs."""
    out = tmp_path / "so.json"
    rc = main(["bench", "structured", "--num-threads", "1", "--kv-cache-memory", "64M",
               "--dataset", "random", "--num-prompts", "3", "--random-input-len", "12",
               "--random-output-len", "10", "--fill-repeats", "3", "--output-json", str(out)])
    assert rc == 0
    report = read(out)
    check_header(report, "structured", "random", 3)
    (pair,) = report["results"]["pairs"]
    assert pair["unconstrained"]["lengths"] == pair["json_schema"]["lengths"]
    assert pair["ratio"] == pytest.approx(pair["json_schema"]["output_tok_s"]
                                          / pair["unconstrained"]["output_tok_s"])
    assert pair["json_schema"]["mask_wait_apply_ms_p99"] >= 0
    assert set(report["results"]["mask_fill_ms_by_batch"]) == {"1", "16", "64"}
