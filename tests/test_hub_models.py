"""Models by the names people type: a Hugging Face repo id resolves through
huggingface_hub to a local snapshot. Nothing is downloaded here: the tests build the
hub's cache layout by hand and run in offline mode (HF_HUB_OFFLINE), as on an air-gapped
machine whose cache was filled elsewhere."""

from __future__ import annotations

import shutil

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.loader import model_loader, model_paths
from tests.server.conftest import tiny_model_dir  # noqa: F401 - the fixture

MAIN = "a" * 40
V2 = "b" * 40


@pytest.fixture
def hub_cache(tmp_path, tiny_model_dir, monkeypatch):  # noqa: F811
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    for ref, commit in (("main", MAIN), ("v2", V2)):
        shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    (repo / "snapshots" / V2 / "notes.bin").write_bytes(b"never read")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model_paths.hub_snapshot.cache_clear()
    yield repo
    model_paths.hub_snapshot.cache_clear()


def test_a_repo_id_loads_its_cached_snapshot(hub_cache, tiny_model_dir):  # noqa: F811
    params = SamplingParams(temperature=0, max_tokens=8)
    local = LLM(tiny_model_dir, kv_cache_memory=8 << 20, max_model_len=256)
    by_name = LLM("tiny-org/tiny-llama", kv_cache_memory=8 << 20, max_model_len=256)
    assert str(by_name.llm_engine.model_path).endswith(MAIN)
    assert by_name.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids == \
        local.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids
    pinned = LLM("tiny-org/tiny-llama", revision="v2", kv_cache_memory=8 << 20,
                 max_model_len=256)
    assert str(pinned.llm_engine.model_path).endswith(V2)


def test_a_repo_not_in_the_cache_offline_says_what_to_do(hub_cache):
    with pytest.raises(ValueError, match="not in the Hugging Face cache") as e:
        model_loader.resolve_model_source("other-org/missing-model")
    assert "huggingface-cli download other-org/missing-model" in str(e.value)


def test_a_missing_path_is_not_taken_for_a_repo_id(tmp_path):
    with pytest.raises(ValueError, match="not a file or directory here"):
        model_loader.resolve_model_source(str(tmp_path / "nothing" / "here.gguf"))
