"""The worker's persistent batch against references built afresh every step.

- Sampling tensors gathered from its columns equal `make_sampling_batch` over per-request
  states (the reference), for random parameters, rows and orders.
- Driven by the real engine through random adds (n > 1, best_of, beam search), aborts
  and forced preemption, after every step: the batch holds exactly the requests the
  scheduler says the worker holds, each row equal to the scheduler's request and block
  table, and the step's tensors equal ones built from the live requests by a slow loop.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedlm import LLM, SamplingParams
from pagedlm.core.sched_output import CachedRequestData, NewRequestData
from pagedlm.csrc import load_extension
from pagedlm.sample.sampling_batch import SamplingRequestState, make_sampling_batch
from pagedlm.worker import input_batch, step_inputs
from pagedlm.worker.input_batch import InputBatch
from tests.core.step_view import attach_views, check_mirror

VOCAB = 50
CPU = torch.device("cpu")

params_st = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_k=st.sampled_from([0, 1, 5, VOCAB, VOCAB + 3]),
    top_p=st.sampled_from([1.0, 0.9]),
    min_p=st.sampled_from([0.0, 0.1]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    frequency_penalty=st.sampled_from([0.0, 0.5]),
    presence_penalty=st.sampled_from([0.0, -0.5]),
    min_tokens=st.sampled_from([0, 3]),
    stop_token_ids=st.sampled_from([None, [4, 70]]),
    ignore_eos=st.booleans(),
    logprobs=st.sampled_from([None, 0, 3]),
    max_tokens=st.just(16),
)
request_st = st.tuples(
    params_st,
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9),  # prompt
    st.lists(st.integers(0, VOCAB - 1), max_size=6),  # output
    st.integers(0, 1 << 64),  # seed
)


def _assert_batches_equal(got, want) -> None:
    for name, value in vars(want).items():
        other = getattr(got, name)
        if isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor), name
            assert other.dtype == value.dtype and torch.equal(other, value), name
        else:
            assert other == value, (name, other, value)


@settings(max_examples=150, deadline=None)
@given(requests=st.lists(request_st, min_size=1, max_size=6), data=st.data())
def test_sampling_batch_equals_reference(requests, data):
    batch = InputBatch(VOCAB, max_num_rows=2, max_num_tokens=2, max_num_blocks=1)
    states = []
    for i, (params, prompt, output, seed) in enumerate(requests):
        batch.add(NewRequestData(f"r{i}", prompt, output, params, seed, (2, 3), [i], 0))
        states.append(SamplingRequestState(params, seed, prompt, output, (2, 3)))
    if data.draw(st.booleans()):  # a removed row, reused by a later request
        batch.remove("r0")
        params, prompt, output, seed = requests[0]
        batch.add(NewRequestData("r0", prompt, output, params, seed, (2, 3), [0], 0))
    order = data.draw(st.permutations(range(len(requests))))
    rows = np.array([batch.row_of[f"r{i}"] for i in order], dtype=np.int64)
    want = make_sampling_batch([states[i] for i in order], VOCAB, CPU)
    _assert_batches_equal(batch.sampling_batch(rows, CPU), want)


# ----- end to end ------------------------------------------------------------------------


def _reference_inputs(engine, sched):
    """The step's tensors from the live requests, one token at a time."""
    s, kv, bs = engine.scheduler, engine.kv_cache_manager, engine.kv_cache_manager.block_size
    computed = {n.req_id: n.num_computed_tokens for n in sched.new_reqs}
    computed.update(zip(sched.cached_reqs.req_ids, sched.cached_reqs.num_computed_tokens))
    items = list(sched.num_scheduled_tokens.items())
    decodes = sorted((it for it in items if it[1] == 1), key=lambda it: -computed[it[0]])
    order = decodes + [it for it in items if it[1] != 1]
    input_ids, positions, slots, seq_lens, tables, sampled, logits_idx = [], [], [], [], [], [], []
    for req_id, num_new in order:
        request = s.requests[req_id]
        table = kv.get_block_ids(req_id)
        start = computed[req_id]
        for pos in range(start, start + num_new):
            input_ids.append(request.all_token_ids[pos])
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
        seq_lens.append(start + num_new)
        tables.append(table)
        if start + num_new == request.num_tokens:
            for rid in [req_id, *(f.req_id for f in sched.fork_reqs.get(req_id, ()))]:
                sampled.append(rid)
                logits_idx.append(len(input_ids) - 1)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return {"input_ids": input_ids, "positions": positions, "slot_mapping": slots,
            "seq_lens": seq_lens, "block_tables": padded, "sampled": sampled,
            "logits_indices": logits_idx}


ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.sampled_from([1, 2, 3]),
                  st.sampled_from([0.0, 1.0])),
        st.tuples(st.just("beam"), st.integers(1, 20), st.integers(2, 6), st.just(2), st.just(0.0)),
        st.tuples(st.just("abort"), st.integers(0, 50), st.just(0), st.just(0), st.just(0.0)),
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0), st.just(0), st.just(0.0)),
    ),
    min_size=1, max_size=30,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops_st, prefix_caching=st.booleans())
def test_engine_persistent_batch_equals_fresh_build(tiny_llama_dir, ops, prefix_caching):
    _run_checked(tiny_llama_dir, ops, prefix_caching)


def test_engine_persistent_batch_through_preemption_forks_and_beams(tiny_llama_dir):
    ops = [("add", 30, 12, 3, 1.0), ("add", 20, 10, 2, 0.0), ("beam", 9, 6, 2, 0.0),
           ("step", 3, 0, 0, 0.0), ("add", 25, 12, 1, 1.0), ("add", 30, 12, 3, 1.0),
           ("step", 2, 0, 0, 0.0), ("abort", 1, 0, 0, 0.0), ("add", 12, 8, 2, 0.0)]
    stats, num_steps, decode_steps = _run_checked(tiny_llama_dir, ops, prefix_caching=True)
    assert num_steps > 20 and 0 < decode_steps < num_steps
    assert stats.num_preemptions > 0 and stats.num_block_copies > 0
    assert stats.prefix_cache_hits > 0


def _run_checked(tiny_llama_dir, ops, prefix_caching):
    # A small cache and step budget: chunked prefills, copy-on-write and preemption happen.
    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, block_size=4, kv_cache_memory=24 * 2048,
              max_num_batched_tokens=16, max_num_seqs=6, max_model_len=64, enforce_eager=True,
              enable_prefix_caching=prefix_caching)
    engine = llm.llm_engine
    runner = engine.model_executor.driver_worker.model_runner
    prepare = runner.prepare_inputs
    num_steps, every_token, kernel_steps = [0], [0], [0]

    def checked(sched):
        inputs = prepare(sched)
        check_mirror(engine.scheduler, runner.input_batch, attach_views(engine.scheduler, sched))
        _check_equal_without_kernel(prepare, sched, inputs, kernel_steps)
        ref = _reference_inputs(engine, sched)
        meta = inputs.meta
        assert inputs.input_ids.tolist() == ref["input_ids"]
        assert inputs.positions.tolist() == ref["positions"]
        assert meta.slot_mapping.tolist() == ref["slot_mapping"]
        assert meta.seq_lens.tolist() == ref["seq_lens"]
        assert meta.block_tables.tolist() == ref["block_tables"]
        assert inputs.sampled_req_ids == ref["sampled"]
        assert inputs.logits_indices.tolist() == ref["logits_indices"]
        if inputs.every_token_sampled:  # the LM head then reads the hidden states as they are
            assert ref["logits_indices"] == list(range(len(ref["input_ids"])))
            every_token[0] += 1
        num_steps[0] += 1
        return inputs

    runner.prepare_inputs = checked
    batch = runner.input_batch
    update = batch.update

    batch.update = lambda sched: _check_update_without_kernel(update, batch, sched)
    prompt_base = 0
    for i, (op, a, b, n, temperature) in enumerate(ops):
        if op == "add":
            prompt = [(prompt_base + j) % 200 + 1 for j in range(a)]
            prompt_base += 7 if i % 2 else 0  # some prompts share prefixes
            params = SamplingParams(n=n, temperature=temperature, seed=i, max_tokens=b,
                                    ignore_eos=True, logprobs=1 if i % 3 == 0 else None)
            engine.add_request(f"q{i}", None, params, prompt_token_ids=prompt)
        elif op == "beam":
            params = SamplingParams(n=n, use_beam_search=True, max_tokens=b, ignore_eos=True,
                                    temperature=0.0)
            engine.add_request(f"q{i}", None, params, prompt_token_ids=list(range(3, 3 + a)))
        elif op == "abort":
            engine.abort_request(f"q{a}")
        else:
            for _ in range(a):
                engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # an idle step
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    engine.scheduler.check_invariants()
    if load_extension("step_inputs_cpu") is not None and every_token[0]:
        assert kernel_steps[0] > 0  # decode-only steps took the kernel
    return engine.get_stats(), num_steps[0], every_token[0]


def _check_update_without_kernel(update, batch, sched) -> None:
    """The batch after `update(sched)` with csrc's apply_token_deltas equals a copy of it
    updated by the numpy branch (the kernel switched off), array for array."""
    twin = copy.deepcopy(batch)
    update(sched)
    kernel = input_batch.load_extension
    input_batch.load_extension = lambda stem: None
    try:
        InputBatch.update(twin, sched)
    finally:
        input_batch.load_extension = kernel
    for name, value in vars(batch).items():
        if not isinstance(value, np.ndarray) or name.startswith("_"):
            continue
        other = getattr(twin, name)
        if value.ndim == 2:  # columns past the narrower one's are zero in the wider one
            width = min(value.shape[1], other.shape[1])
            assert not value[:, width:].any() and not other[:, width:].any(), name
            value, other = value[:, :width], other[:, :width]
        assert np.array_equal(value, other), name


@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_token_delta_kernel_equals_numpy(data):
    """csrc's apply_token_deltas against InputBatch's numpy branch on random deltas: empty
    (a prompt chunk), one token appended or replacing the last, longer (left to the
    caller), over random rows of a batch."""
    kernels = load_extension("step_inputs_cpu")
    if kernels is None:
        pytest.skip("the CPU kernels are not built here")
    num_rows, width = data.draw(st.integers(1, 8)), 16
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    rows = rng.permutation(num_rows)[:data.draw(st.integers(1, num_rows))].astype(np.int64)
    cached = CachedRequestData()
    for row in rows.tolist():
        length = int(rng.integers(1, width - 4))
        kind = data.draw(st.sampled_from(["none", "append", "replace", "longer"]))
        offset = {"none": length, "append": length, "replace": length - 1, "longer": length}[kind]
        tokens = {"none": [], "longer": rng.integers(0, 99, 3).tolist()}.get(
            kind, [int(rng.integers(0, 99))])
        cached.append(f"r{row}", offset, tokens, 0, [], int(rng.integers(0, 50)))
    want = InputBatch(100, max_num_rows=num_rows, max_num_tokens=width)
    for name in ("token_ids", "num_tokens", "num_computed_tokens"):
        getattr(want, name)[:] = rng.integers(0, 99, getattr(want, name).shape)
    got = copy.deepcopy(want)
    longer = want._apply_one_token_deltas(rows, cached)
    assert kernels.apply_token_deltas(rows, cached.num_computed_tokens, cached.new_token_ids,
                                      cached.token_offsets, got.num_computed_tokens,
                                      got.num_tokens, got.token_ids) == longer
    for name in ("token_ids", "num_tokens", "num_computed_tokens"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
    with pytest.raises(RuntimeError, match="outside its 16 token columns"):
        kernels.apply_token_deltas(rows[:1], [0], [[5]], [width], got.num_computed_tokens,
                                   got.num_tokens, got.token_ids)


def _check_equal_without_kernel(prepare, sched, inputs, kernel_steps) -> None:
    """A decode-only step's inputs from csrc/step_inputs_cpu.cpp equal those of the numpy
    branch of worker/step_inputs.py (the kernel switched off), field for field."""
    layout = step_inputs._decode_layout
    kernel_steps[0] += layout(*_layout_args(prepare, sched)) is not None if _decodes_only(sched) else 0
    step_inputs._decode_layout = lambda *args: None
    try:
        want = prepare(sched)
    finally:
        step_inputs._decode_layout = layout
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(inputs, name), getattr(want, name)), name
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        assert torch.equal(getattr(inputs.meta, name), getattr(want.meta, name)), name
    for name in ("num_decodes", "num_prefills", "num_tokens", "max_query_len", "max_seq_len",
                 "query_start_loc_cpu", "seq_lens_cpu"):
        assert getattr(inputs.meta, name) == getattr(want.meta, name), name
    assert np.array_equal(inputs.sampled_rows, want.sampled_rows)
    assert inputs.sampled_req_ids == want.sampled_req_ids
    assert inputs.every_token_sampled == want.every_token_sampled


def _decodes_only(sched) -> bool:
    return not sched.spec_token_ids and sched.total_num_scheduled_tokens == len(sched.num_scheduled_tokens)


def _layout_args(prepare, sched):
    batch = prepare.__self__.input_batch
    rows = np.array([batch.row_of[r] for r in sched.num_scheduled_tokens], dtype=np.int64)
    return batch, rows, prepare.__self__.block_size

