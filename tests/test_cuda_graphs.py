"""Decode steps padded to a captured batch size: the padding must change no real row.

On CPU the padded static-buffer path runs eagerly (no capture) through the Triton
backend under the interpreter and is compared with the unpadded path on a tiny model.
With CUDA, the same comparison runs with real graph capture and replay.
"""

import os
import sys

import pytest
import torch

_ON_GPU = torch.cuda.is_available()
if not _ON_GPU:
    # As in test_triton_attention.py: the interpreter must be chosen before triton loads.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set",
                    allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from pagedlm import LLM, SamplingParams  # noqa: E402
from pagedlm.attention import triton_kernels as tk  # noqa: E402
from pagedlm.attention.metadata import AttentionMetadata  # noqa: E402
from pagedlm.worker.cuda_graphs import DecodeGraphRunner, capture_sizes, padded_size  # noqa: E402

if not _ON_GPU and not tk._INTERPRETED:
    pytest.skip("triton_kernels was imported in compiled mode", allow_module_level=True)

requires_cuda = pytest.mark.skipif(not _ON_GPU, reason="needs CUDA")

# Prompts of different lengths and outputs of different lengths: the decode batch
# shrinks 5 -> 3 -> 2 -> 1 as requests finish (padded to 8, 4, 2, 1).
PROMPTS = [{"prompt_token_ids": [(7 * i + j) % 500 + 1 for j in range(n)]}
           for i, n in enumerate([3, 9, 17, 5, 12])]
MAX_TOKENS = [4, 9, 6, 9, 7]


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and capture_sizes(256)[-1] == 256
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)
    sizes = capture_sizes(32)
    assert [padded_size(sizes, n) for n in (1, 3, 5, 9, 32, 33)] == [1, 4, 8, 16, 32, None]


class _Recorder(torch.nn.Module):
    """Stands in for a model: records what the padded path hands it."""

    def forward(self, input_ids, positions, meta: AttentionMetadata):
        self.seen = (input_ids.clone(), positions.clone(), meta.slot_mapping.clone(),
                     meta.seq_lens.clone(), meta.block_tables.clone(), meta)
        return input_ids[:, None].float() * 10  # [b, 1]


def _decode_meta(seq_lens, block_tables, slots):
    n = len(seq_lens)
    return AttentionMetadata(
        num_decodes=n, num_decode_tokens=n, num_prefills=0, num_tokens=n, max_query_len=1,
        max_seq_len=max(seq_lens), query_start_loc=torch.arange(n + 1),
        seq_lens=torch.tensor(seq_lens), block_tables=torch.tensor(block_tables),
        slot_mapping=torch.tensor(slots), query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=list(seq_lens))


def test_padding_rows_write_nothing_and_attend_to_nothing():
    model = _Recorder()
    runner = DecodeGraphRunner(model, torch.device("cpu"), max_num_seqs=8, max_model_len=32,
                               block_size=4, capture=False)
    assert runner.max_num_blocks == 8
    # 5 rows first, then 3: rows 3..3 of the second step are padding again.
    runner.run(torch.arange(5) + 1, torch.arange(5), _decode_meta(
        [5, 4, 3, 2, 1], [[1, 2], [3, 0], [4, 0], [5, 0], [6, 0]], [5, 12, 18, 21, 24]))
    meta = _decode_meta([9, 6, 2], [[1, 2, 7], [3, 8, 0], [4, 0, 0]], [28, 33, 17])
    hidden = runner.run(torch.tensor([11, 12, 13]), torch.tensor([8, 5, 1]), meta)
    ids, pos, slots, seq_lens, tables, static_meta = model.seen
    assert hidden.tolist() == [[110.0], [120.0], [130.0]]
    assert ids.shape == (4,) and ids[:3].tolist() == [11, 12, 13]
    assert pos[:3].tolist() == [8, 5, 1]
    assert slots.tolist() == [28, 33, 17, -1]
    assert seq_lens.tolist() == [9, 6, 2, 0]
    assert tables[:3, :3].tolist() == [[1, 2, 7], [3, 8, 0], [4, 0, 0]]
    assert tables.shape == (4, 8)
    # The backend plans from upper bounds that hold for every step of this size.
    assert static_meta.seq_lens_cpu == [32] * 4 and static_meta.num_decodes == 4
    assert runner.num_steps == 2 and runner.num_padding_rows == 3 + 1
    assert runner.can_run(meta)
    assert not runner.can_run(_decode_meta([1] * 9, [[0]] * 9, list(range(9))))
    wide = _decode_meta([1], [[0] * 9], [0])
    assert not runner.can_run(wide)


def test_capture_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphRunner(_Recorder(), torch.device("cpu"), 4, 32, 4, capture=True)


def _generate(llm):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=3)
              for m in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outs]
    return tokens, logprobs


def _llm(model_dir, device, dtype, **kw):
    return LLM(model_dir, skip_tokenizer_init=True, attention_backend="triton", device=device,
               dtype=dtype, block_size=4, kv_cache_memory=1 << 22, max_model_len=128,
               max_num_seqs=8, **kw)


def _assert_close(ref, got, atol):
    for a, b in zip(ref, got):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=atol), (a, b)


@pytest.mark.skipif(_ON_GPU, reason="runs the Triton kernels on CPU tensors, which only the "
                    "interpreter takes; on CUDA test_cuda_graph_replay_matches_eager pads for real")
def test_padded_decode_matches_unpadded_on_cpu(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, "cpu", "float32")
    engine = llm.llm_engine
    assert not engine.model_executor.driver_worker.cuda_graphs and engine.model_executor.driver_worker.model_runner.decode_graphs is None
    ref_tokens, ref_lps = _generate(llm)
    engine.reset_prefix_cache()
    engine.model_executor.driver_worker.model_runner.enable_decode_graphs(8, engine.max_model_len, capture=False)
    tokens, lps = _generate(llm)
    graphs = engine.model_executor.driver_worker.model_runner.decode_graphs
    assert graphs.num_steps >= max(MAX_TOKENS) - 1 and graphs.num_padding_rows > 0
    assert tokens == ref_tokens
    _assert_close(ref_lps, lps, atol=1e-4)


@requires_cuda
@pytest.mark.parametrize("dtype,atol", [("float32", 1e-3), ("bfloat16", 0.1)])
def test_cuda_graph_replay_matches_eager(tiny_llama_dir, dtype, atol):
    eager = _llm(tiny_llama_dir, "cuda", dtype, enforce_eager=True)
    assert not eager.llm_engine.model_executor.driver_worker.cuda_graphs
    ref_tokens, ref_lps = _generate(eager)
    del eager
    graphed = _llm(tiny_llama_dir, "cuda", dtype)
    engine = graphed.llm_engine
    assert engine.model_executor.driver_worker.cuda_graphs and sorted(engine.model_executor.driver_worker.model_runner.decode_graphs.graphs) == [1, 2, 4, 8]
    tokens, lps = _generate(graphed)
    assert engine.model_executor.driver_worker.model_runner.decode_graphs.num_steps >= max(MAX_TOKENS) - 1
    if dtype == "float32":
        assert tokens == ref_tokens
    else:  # a bf16 near-tie may flip: compare the first steps only
        assert [t[:2] for t in tokens] == [t[:2] for t in ref_tokens]
    _assert_close([lp[:2] for lp in ref_lps], [lp[:2] for lp in lps], atol=atol)


@requires_cuda
def test_torch_backend_and_enforce_eager_stay_eager(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, device="cuda", block_size=4,
              kv_cache_memory=1 << 22, max_model_len=128, max_num_seqs=8)
    assert not llm.llm_engine.model_executor.driver_worker.cuda_graphs and llm.llm_engine.model_executor.driver_worker.model_runner.decode_graphs is None
