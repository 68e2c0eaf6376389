"""`pagedlm bench lora` end to end on the embedded SmolLM2 (a couple of short requests)."""

from __future__ import annotations

import json

from tests.conftest import requires_smollm2


@requires_smollm2
def test_bench_lora_runs(tmp_path):
    from pagedlm.entrypoints.cli import main

    out = tmp_path / "lora.json"
    assert main(["bench", "lora", "--num-prompts", "2", "--num-adapters", "2",
                 "--lora-rank", "4", "--max-output-len", "4", "--load-repeats", "1", "--pairs", "2",
                 "--kv-cache-memory", "64M", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    runs = report["throughput"]
    assert [r["output_tokens"] for r in runs["base"] + runs["lora"]] == [8] * 4  # 2 pairs
    assert len(runs["ratios_lora_over_base"]) == 2 and runs["ratio_lora_over_base"] > 0
    load = report["adapter_load"]
    assert len(load["add_ms_each"]) == 2 and load["slot_write_ms_median"] > 0
    assert load["adapter_mib"] > 0
