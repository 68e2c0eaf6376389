"""Loading a checkpoint that takes a while shows a progress bar of its tensors (here forced
by a zero delay); the count it goes to is the checkpoint's."""

from __future__ import annotations

from pagedlm.loader import model_loader
from pagedlm.loader.safetensors_loader import count_safetensors, iterate_safetensors


def test_weights_load_with_a_progress_bar(tiny_llama_dir, monkeypatch, capsys):
    from pagedlm import LLM

    total = count_safetensors(tiny_llama_dir)
    assert total == sum(1 for _ in iterate_safetensors(tiny_llama_dir))
    monkeypatch.setattr(model_loader, "PROGRESS_DELAY_S", 0.0)
    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, kv_cache_memory=4 << 20,
              max_model_len=64)
    llm.llm_engine.shutdown()
    err = capsys.readouterr().err
    assert "loading weights" in err and f"{total}/{total}" in err
