"""`ollama:NAME[:TAG]`: a model an Ollama user already pulled, read from Ollama's store
(manifests/<registry>/<namespace>/<name>/<tag> naming a blobs/sha256-<hex> GGUF layer)."""

import hashlib
import json
import os

import pytest

from pagedlm.loader import ollama
from tests.conftest import requires_smollm2, smollm2_path


def _pull(root, name, blob_source=None, media_type=ollama.MODEL_MEDIA_TYPE):
    """What `ollama pull` leaves: a manifest and the model blob (here a link to a file)."""
    registry, namespace, model, tag = ollama.parse_name(name)
    digest = hashlib.sha256(name.encode()).hexdigest()
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    blob = blobs / f"sha256-{digest}"
    if blob_source is not None:
        os.symlink(blob_source, blob)
    manifest = root / "manifests" / registry / namespace / model / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:00"},
        {"mediaType": media_type, "digest": f"sha256:{digest}", "size": 1}]}))
    return str(blob)


def test_names_take_ollamas_defaults():
    assert ollama.parse_name("llama3.2") == ("registry.ollama.ai", "library", "llama3.2", "latest")
    assert ollama.parse_name("llama3.2:1b") == ("registry.ollama.ai", "library", "llama3.2", "1b")
    assert ollama.parse_name("me/tiny:q4") == ("registry.ollama.ai", "me", "tiny", "q4")
    assert ollama.parse_name("hf.co/me/tiny:q4") == ("hf.co", "me", "tiny", "q4")
    for bad in ("", "a/b/c/d", "a//b", "x:y:z"):
        with pytest.raises(ValueError, match="is not NAME"):
            ollama.parse_name(bad)


def test_resolve_finds_the_model_layer_and_says_what_is_missing(tmp_path):
    blob = _pull(tmp_path, "smol:135m", blob_source=__file__)
    _pull(tmp_path, "hf.co/me/other:q8", blob_source=__file__)
    assert ollama.resolve("ollama:smol:135m", tmp_path) == blob
    assert ollama.pulled_models(tmp_path) == ["hf.co/me/other:q8", "smol:135m"]
    with pytest.raises(ValueError, match=r"'smol' not found \(pulled here: hf.co/me/other:q8, "
                                         r"smol:135m\); run `ollama pull smol`"):
        ollama.resolve("ollama:smol", tmp_path)
    with pytest.raises(ValueError, match="no model is pulled in"):
        ollama.resolve("ollama:smol", tmp_path / "empty")
    _pull(tmp_path, "gone", blob_source=None)  # manifest without its blob
    with pytest.raises(ValueError, match="its file .* is missing; run `ollama pull gone` again"):
        ollama.resolve("ollama:gone", tmp_path)
    _pull(tmp_path, "odd", media_type="application/vnd.ollama.image.adapter")
    with pytest.raises(ValueError, match="names no model layer"):
        ollama.resolve("ollama:odd", tmp_path)


@requires_smollm2
def test_a_pulled_model_generates_as_its_gguf_file_does(tmp_path, monkeypatch):
    from pagedlm import LLM, SamplingParams

    _pull(tmp_path, "smollm2:135m", blob_source=smollm2_path())
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=8)
    outs = {}
    for model in ("ollama:smollm2:135m", smollm2_path()):
        llm = LLM(model, kv_cache_memory=1 << 25, max_model_len=256)
        outs[model] = llm.generate(["The capital of France is"], params,
                                   use_tqdm=False)[0].outputs[0].text
        del llm
    assert outs["ollama:smollm2:135m"] == outs[smollm2_path()] and outs[smollm2_path()]
