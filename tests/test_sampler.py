import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedlm.sample.noise import random_uniform
from pagedlm.sample.ops import (
    apply_frequency_presence_penalties,
    apply_min_p,
    apply_repetition_penalty,
    apply_top_k_top_p,
    compute_logprobs,
)
from pagedlm.sample.sampler import Sampler
from pagedlm.sample.sampling_batch import SamplingRequestState, make_sampling_batch
from pagedlm.sampling_params import SamplingParams

CPU = torch.device("cpu")
NEG_INF = float("-inf")
sampler = Sampler()


def state(
    params: SamplingParams,
    seed: int = 0,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    eos: Sequence[int] = (),
) -> SamplingRequestState:
    return SamplingRequestState(params, seed, list(prompt), list(output), list(eos))


def sample(logits: torch.Tensor, states: list[SamplingRequestState]):
    batch = make_sampling_batch(states, logits.shape[-1], CPU)
    return sampler(logits, batch)


def kept(masked: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in masked]


# --- counter-based noise -------------------------------------------------------


def _splitmix_ref(seed: int, step: int, j: int) -> int:
    m = (1 << 64) - 1

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    g = 0x9E3779B97F4A7C15
    key = mix(mix((seed + g) & m) ^ step)
    return mix((key + (j + 1) * g) & m)


def test_noise_matches_unsigned_reference() -> None:
    seeds = [0, 1, 12345, 2**62 + 7, 2**63 - 1]
    steps = [0, 1, 99, 5, 2**40]
    u = random_uniform(torch.tensor(seeds), torch.tensor(steps), 37)
    for r, (s, t) in enumerate(zip(seeds, steps)):
        for j in (0, 1, 17, 36):
            expected = ((_splitmix_ref(s, t, j) >> 41) + 0.5) / 2**23
            assert u[r, j].item() == expected


def test_noise_is_uniform_in_open_interval() -> None:
    u = random_uniform(torch.arange(64), torch.zeros(64, dtype=torch.int64), 1000)
    assert u.dtype == torch.float32 and u.shape == (64, 1000)
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.01
    assert abs((u < 0.25).float().mean().item() - 0.25) < 0.01
    # Neighbouring seeds and steps give unrelated streams.
    assert not torch.equal(u[0], u[1])
    v = random_uniform(torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 1000)
    assert not torch.equal(u[0], v[0])


# --- masks ---------------------------------------------------------------------


def test_top_k_exact() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 2.0, 4.0], [1.0, 5.0, 3.0, 2.0, 4.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 0]), None)
    assert kept(out) == [[1, 4], [0, 1, 2, 3, 4]]
    assert out[0, 1] == 5.0 and out[0, 4] == 4.0  # kept values untouched
    assert torch.equal(apply_top_k_top_p(logits, torch.tensor([1, 5]), None, max_k=1)[1], logits[1])
    assert kept(apply_top_k_top_p(logits, torch.tensor([1, 9]), None)) == [[1], [0, 1, 2, 3, 4]]


def test_top_k_keeps_ties() -> None:
    logits = torch.tensor([[2.0, 3.0, 3.0, 1.0]])
    assert kept(apply_top_k_top_p(logits, torch.tensor([1]), None)) == [[1, 2]]


def test_top_p_exact() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().repeat(4, 1)
    p = torch.tensor([0.45, 0.7, 0.9, 1.0])
    assert kept(apply_top_k_top_p(logits, None, p)) == [[1], [1, 3], [1, 2, 3], [0, 1, 2, 3]]


def test_top_k_then_top_p_renormalises() -> None:
    # After top-k=2 the distribution is {1: 0.625, 3: 0.375}; top_p=0.6 keeps only
    # token 1 even though 0.6 > 0.5, its unrenormalised probability.
    logits = torch.tensor([[0.05, 0.5, 0.15, 0.3]]).log()
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.6]))
    assert kept(out) == [[1]]
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.7]))
    assert kept(out) == [[1, 3]]


def test_min_p_exact() -> None:
    logits = torch.tensor([0.05, 0.5, 0.15, 0.3]).log().repeat(3, 1)
    out = apply_min_p(logits, torch.tensor([0.0, 0.2, 0.5]))
    # thresholds min_p * max prob (0.5): 0, 0.1, 0.25
    assert kept(out) == [[0, 1, 2, 3], [1, 2, 3], [1, 3]]


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20, width=32), min_size=1, max_size=12),
    k=st.integers(0, 14),
    p=st.floats(0.01, 1.0),
)
def test_top_k_top_p_mask_is_a_top_set(logits: list[float], k: int, p: float) -> None:
    x = torch.tensor([logits])
    out = apply_top_k_top_p(x, torch.tensor([k]), torch.tensor([p]))
    keep = torch.isfinite(out[0])
    assert keep.any()
    if k > 0:
        # Only ties with the k-th value may push the kept count beyond k.
        kth = x[0].sort(descending=True).values[min(k, len(logits)) - 1]
        assert (x[0][keep] >= kth).all()
    if (~keep).any():
        assert x[0][keep].min() > x[0][~keep].max()
        # The dropped tokens carry at most 1 - p of the (top-k) mass.
        base = apply_top_k_top_p(x, torch.tensor([k]), None)
        probs = base.softmax(-1)[0]
        assert probs[keep].sum().item() >= p - 1e-5


# --- penalties -----------------------------------------------------------------


def test_penalty_helpers_match_definitions() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([2.0]))
    assert out.tolist() == [[1.0, -2.0, 0.5, -3.0]]
    counts = torch.tensor([[3, 0, 1, 0]])
    out = apply_frequency_presence_penalties(
        logits, counts, torch.tensor([0.5]), torch.tensor([0.25])
    )
    assert out.tolist() == [[2.0 - 1.5 - 0.25, -1.0, 0.5 - 0.5 - 0.25, -3.0]]


def test_penalties_in_sampler_steer_greedy() -> None:
    # Token 0 leads by 1.0 without penalties.
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    greedy = SamplingParams(temperature=0)
    assert sample(logits, [state(greedy, output=[0, 0])]).sampled_token_ids.item() == 0
    # frequency: 3 - 2 * 0.6 = 1.8 < 2.0
    p = SamplingParams(temperature=0, frequency_penalty=0.6)
    assert sample(logits, [state(p, output=[0, 0])]).sampled_token_ids.item() == 1
    # presence counts once: 3 - 0.9 = 2.1 > 2.0, then 3 - 1.1 = 1.9 < 2.0
    p = SamplingParams(temperature=0, presence_penalty=0.9)
    assert sample(logits, [state(p, output=[0, 0])]).sampled_token_ids.item() == 0
    p = SamplingParams(temperature=0, presence_penalty=1.1)
    assert sample(logits, [state(p, output=[0, 0])]).sampled_token_ids.item() == 1
    # presence/frequency ignore the prompt; repetition does not: 3 / 1.6 < 2.
    p = SamplingParams(temperature=0, presence_penalty=2.0)
    assert sample(logits, [state(p, prompt=[0])]).sampled_token_ids.item() == 0
    p = SamplingParams(temperature=0, repetition_penalty=1.6)
    assert sample(logits, [state(p, prompt=[0])]).sampled_token_ids.item() == 1
    # A penalty-free row in the same batch is untouched.
    out = sample(logits.repeat(2, 1), [state(p, prompt=[0]), state(greedy, prompt=[0])])
    assert out.sampled_token_ids.tolist() == [1, 0]


def test_negative_logit_repetition_multiplies() -> None:
    logits = torch.tensor([[-1.0, -1.5, -9.0]])
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    # -1 * 2 = -2 < -1.5
    assert sample(logits, [state(p, output=[0])]).sampled_token_ids.item() == 1


# --- min_tokens ----------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    assert sample(logits, [state(p, output=[3], eos=[0])]).sampled_token_ids.item() == 2
    # Reached min_tokens: nothing masked.
    assert sample(logits, [state(p, output=[3, 3], eos=[0])]).sampled_token_ids.item() == 0
    # ignore_eos: EOS is not a stop, so it is not masked; stop ids still are.
    q = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1], ignore_eos=True)
    assert sample(logits, [state(q, eos=[0])]).sampled_token_ids.item() == 0
    logits2 = torch.tensor([[4.0, 5.0, 3.0, 0.0]])
    assert sample(logits2, [state(q, eos=[0])]).sampled_token_ids.item() == 0
    # Ids outside the vocabulary are ignored rather than crashing.
    r = SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[99])
    assert sample(logits, [state(r, eos=[0, 1000])]).sampled_token_ids.item() == 1


def test_min_tokens_applies_to_random_rows() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0]]).repeat(200, 1)
    p = SamplingParams(min_tokens=1, stop_token_ids=[2])
    states = [state(p, seed=s, eos=[0]) for s in range(200)]
    assert (sample(logits, states).sampled_token_ids == 1).all()


# --- greedy and random sampling ------------------------------------------------


def test_greedy_is_argmax_and_does_not_modify_logits() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 50, generator=g)
    before = logits.clone()
    p = SamplingParams(temperature=0, repetition_penalty=1.5, min_tokens=3)
    out = sample(logits, [state(p, seed=i, prompt=[1], eos=[2]) for i in range(8)])
    expected = apply_repetition_penalty(
        logits,
        torch.zeros(8, 50, dtype=torch.bool).index_fill(1, torch.tensor([1]), True),
        torch.full((8,), 1.5),
    )
    expected[:, 2] = NEG_INF
    assert torch.equal(out.sampled_token_ids, expected.argmax(-1))
    assert torch.equal(logits, before)
    assert out.sampled_logprobs is None and out.topk_token_ids is None


def test_temperature_distribution() -> None:
    # Many rows with distinct seeds in one batch: the empirical distribution must
    # be close to softmax(logits / T). Fixed seeds, so this cannot flake.
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 4000
    for temp in (0.5, 1.0, 2.0):
        p = SamplingParams(temperature=temp)
        out = sample(logits.repeat(n, 1), [state(p, seed=s) for s in range(n)])
        freq = torch.bincount(out.sampled_token_ids, minlength=4).float() / n
        expected = (logits / temp).softmax(-1)
        assert (freq - expected).abs().max().item() < 0.03, (temp, freq, expected)


def test_random_sample_stays_within_masks_and_spreads() -> None:
    logits = torch.tensor([0.05, 0.5, 0.15, 0.3, 1e-4]).log()
    n = 2000
    p = SamplingParams(top_k=3, top_p=0.75)  # top-3 renormalised: .53, .32, .16 -> {1, 3}
    out = sample(logits.repeat(n, 1), [state(p, seed=s) for s in range(n)])
    freq = torch.bincount(out.sampled_token_ids, minlength=5).float() / n
    assert freq[0] == freq[2] == freq[4] == 0
    assert abs(freq[1].item() - 0.625) < 0.04


def test_seeded_reproducible_and_batch_independent() -> None:
    vocab = 64

    def logits_for(row: int, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * row + step)
        return torch.randn(vocab, generator=g) * 2  # [vocab]

    params = [
        SamplingParams(temperature=0.8, seed=11),
        SamplingParams(temperature=1.3, top_k=10),
        SamplingParams(top_p=0.9, min_p=0.05, repetition_penalty=1.1),
        SamplingParams(temperature=0),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.3, logprobs=2),
    ]
    seeds = [11, 2**64 + 5, -3, 7, 123456789]
    outputs: list[list[int]] = [[] for _ in params]
    steps = 12
    # Batch run: all rows, in a different order at each step.
    for step in range(steps):
        order = torch.randperm(len(params), generator=torch.Generator().manual_seed(step)).tolist()
        states = [state(params[r], seeds[r], [1, 2, 3], outputs[r], [0]) for r in order]
        logits = torch.stack([logits_for(r, step) for r in order])
        toks = sample(logits, states).sampled_token_ids.tolist()
        for r, t in zip(order, toks):
            outputs[r].append(t)
    # Each row alone reproduces its batch tokens, step by step.
    for r in range(len(params)):
        alone: list[int] = []
        for step in range(steps):
            st_ = state(params[r], seeds[r], [1, 2, 3], alone, [0])
            alone.append(sample(logits_for(r, step)[None], [st_]).sampled_token_ids.item())
        assert alone == outputs[r], r
    # And the random rows are not constant (the noise advances with the step).
    assert len(set(outputs[1])) > 1


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, 1000)
    p = SamplingParams()
    toks = {sample(logits, [state(p, seed=s)]).sampled_token_ids.item() for s in range(20)}
    assert len(toks) > 15


def test_tiny_temperature_is_near_greedy() -> None:
    logits = torch.tensor([[1.0, 1.2, 0.9]]).repeat(50, 1)
    p = SamplingParams(temperature=1e-3)
    out = sample(logits, [state(p, seed=s) for s in range(50)])
    assert (out.sampled_token_ids == 1).all()


# --- logprobs ------------------------------------------------------------------


def test_logprobs_are_raw_with_ranks_and_sorted_topk() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    raw = logits.log_softmax(-1)
    states = [
        # Penalties and temperature must not affect the reported logprobs.
        state(SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=3), prompt=[1]),
        state(SamplingParams(temperature=0, logprobs=0)),
    ]
    out = sample(logits, states)
    assert out.sampled_token_ids.tolist() == [2, 2]
    assert torch.allclose(out.sampled_logprobs, raw[[0, 1], [2, 2]])
    assert out.sampled_ranks.tolist() == [2, 1]
    assert out.topk_token_ids.shape == (2, 3)
    assert out.topk_token_ids[0].tolist() == [1, 2, 0]
    assert torch.allclose(out.topk_logprobs, raw.gather(1, out.topk_token_ids))
    assert (out.topk_logprobs[:, :-1] >= out.topk_logprobs[:, 1:]).all()


def test_logprobs_zero_gives_empty_topk() -> None:
    logits = torch.tensor([[1.0, 2.0]])
    out = sample(logits, [state(SamplingParams(logprobs=0), seed=1)])
    assert out.topk_token_ids.shape == (1, 0) and out.topk_logprobs.shape == (1, 0)
    assert out.sampled_logprobs.dtype == torch.float32
    assert out.sampled_ranks.dtype == torch.int64


def test_compute_logprobs_for_prompt_tokens_and_ties() -> None:
    logits = torch.tensor([[0.0, 0.0, -1.0], [2.0, 1.0, 1.0]])
    lp, ranks, ids, top = compute_logprobs(logits, torch.tensor([1, 2]), 10)
    assert ranks.tolist() == [1, 2]  # ties share the better rank
    assert math.isclose(lp[1].item(), logits[1].log_softmax(-1)[2].item(), rel_tol=1e-6)
    assert ids.shape == (2, 3) and top.shape == (2, 3)  # clamped to vocab
    with pytest.raises(ValueError, match="num_top"):
        compute_logprobs(logits, torch.tensor([0, 0]), -1)


# --- batch construction --------------------------------------------------------


def test_batch_skips_unneeded_work() -> None:
    b = make_sampling_batch([state(SamplingParams(temperature=0))] * 3, 10, CPU)
    assert b.all_greedy and not b.all_random and b.temperature is None
    assert b.seen_mask is None and b.output_counts is None and b.min_tokens_rows is None
    assert b.max_num_logprobs is None
    b = make_sampling_batch(
        [state(SamplingParams(top_k=20)), state(SamplingParams(temperature=0, top_k=3))], 10, CPU
    )
    # top_k >= vocab is a no-op; the greedy row's top_k is irrelevant.
    assert b.top_k is None and b.top_p is None and b.min_p is None
    assert b.random_rows.tolist() == [0]
    b = make_sampling_batch(
        [state(SamplingParams(logprobs=2)), state(SamplingParams(logprobs=5, top_k=4))], 10, CPU
    )
    assert b.all_random and b.random_rows is None and b.max_num_logprobs == 5
    assert b.top_k.tolist() == [0, 4] and b.max_top_k == 4


def test_shape_and_vocab_errors() -> None:
    b = make_sampling_batch([state(SamplingParams())], 10, CPU)
    with pytest.raises(ValueError, match="logits"):
        sampler(torch.zeros(2, 10), b)
    with pytest.raises(ValueError, match="vocab_size"):
        make_sampling_batch([], 0, CPU)
    empty = make_sampling_batch([], 10, CPU)
    assert sampler(torch.zeros(0, 10), empty).sampled_token_ids.shape == (0,)


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-10, 10, width=32), min_size=2, max_size=16),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(0, 16),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 1.0),
    seed=st.integers(-(2**70), 2**70),
)
def test_sampled_token_survives_all_masks(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float, seed: int
) -> None:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    x = torch.tensor([logits])
    tok = sample(x, [state(params, seed=seed)]).sampled_token_ids.item()
    y = x / torch.tensor(temperature, dtype=torch.float32)
    y = apply_min_p(y, torch.tensor([min_p]))
    y = apply_top_k_top_p(y, torch.tensor([top_k]), torch.tensor([top_p]))
    assert math.isfinite(y[0, tok].item())


# --- rows that cannot be sampled ------------------------------------------------

_ROW_PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4),
    SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7]),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.1, presence_penalty=0.5),
    SamplingParams(temperature=0.9, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=1.2, min_p=0.2),
    SamplingParams(temperature=0.7, min_tokens=2, logprobs=2),
]
_SPECIALS = {"nan": float("nan"), "inf": float("inf"), "-inf": NEG_INF}


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.integers(0, len(_ROW_PARAMS) - 1),
            # where a bad value goes: (kind, token), or the whole row -inf
            # (token 7 often: the EOS and stop id that min_tokens masks)
            st.lists(st.tuples(st.sampled_from(sorted(_SPECIALS)),
                               st.one_of(st.just(7), st.integers(0, 39))), max_size=3),
            st.booleans(),
        ),
        min_size=1, max_size=6,
    ),
    kernels=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_unsampleable_rows_are_exactly_the_nonfinite_ones(rows, kernels: bool, seed: int):
    """The sampler's cheap check (the raw logit at each pick, stage 6) flags exactly the
    rows that the full reduction of model_runner.nonfinite_rows flags, whatever each row's
    parameters (greedy, penalties, min_tokens masking the bad token, filters), and the
    other rows' tokens are as sampled without the bad rows beside them."""
    from pagedlm.worker.model_runner import _sampled_lists, nonfinite_rows

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), 40, generator=gen)
    states = []
    for i, (which, specials, all_masked) in enumerate(rows):
        for kind, token in specials:
            logits[i, token] = _SPECIALS[kind]
        if all_masked:
            logits[i] = NEG_INF
        # eos 7 and stop id 7: a bad logit there is what min_tokens masks
        states.append(state(_ROW_PARAMS[which], seed=seed + i, prompt=[1, 2, 7], output=[3],
                            eos=[7]))
    batch = make_sampling_batch(states, 40, CPU)
    result = Sampler(use_cpu_kernels=kernels)(logits, batch)
    bad = nonfinite_rows(logits)
    assert [i for i, v in enumerate(result.sampled_logits.tolist()) if not math.isfinite(v)] == bad
    got, runner_bad = _sampled_lists(result)[:2]  # what the model runner fails
    assert runner_bad == bad
    # The others: as sampled one by one, without the bad rows beside them.
    for i, token in enumerate(got):
        if i not in bad:
            one = make_sampling_batch([states[i]], 40, CPU)
            assert token == Sampler(use_cpu_kernels=kernels)(logits[i:i + 1], one) \
                .sampled_token_ids.item()
