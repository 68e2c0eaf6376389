"""The synthetic benchmark datasets: random token ids and shared prefixes."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from pagedlm.benchmarks.dataset_args import build_requests
from pagedlm.benchmarks.datasets import (
    SampleRequest,
    sample_lengths,
    sample_prefix,
    sample_random,
)


def test_sample_request_keeps_its_old_three_field_form() -> None:
    r = SampleRequest("p", 3, 4)
    assert r.prompt_token_ids is None
    assert r == SampleRequest(prompt="p", prompt_len=3, output_len=4)


def test_random_fixed_lengths_and_vocabulary() -> None:
    reqs = sample_random(20, input_len=17, output_len=5, vocab_size=50, seed=3)
    assert len(reqs) == 20
    for r in reqs:
        assert r.prompt_len == 17 and r.output_len == 5
        assert r.prompt_token_ids is not None and len(r.prompt_token_ids) == 17
        assert all(0 <= t < 50 for t in r.prompt_token_ids)
        assert r.prompt == ""
    # Random prompts differ from one another.
    assert len({r.prompt_token_ids for r in reqs}) == 20


def test_random_is_deterministic_per_seed() -> None:
    a = sample_random(8, 32, 8, 1000, range_ratio=0.5, seed=7)
    assert a == sample_random(8, 32, 8, 1000, range_ratio=0.5, seed=7)
    assert a != sample_random(8, 32, 8, 1000, range_ratio=0.5, seed=8)


def test_random_range_ratio_bounds() -> None:
    reqs = sample_random(400, input_len=100, output_len=10, vocab_size=10, range_ratio=0.5,
                         seed=0)
    prompt_lens = {r.prompt_len for r in reqs}
    output_lens = {r.output_len for r in reqs}
    assert min(prompt_lens) >= 50 and max(prompt_lens) <= 150
    assert min(output_lens) >= 5 and max(output_lens) <= 15
    assert len(prompt_lens) > 20  # really spread, not constant
    assert all(len(r.prompt_token_ids or ()) == r.prompt_len for r in reqs)


def test_sample_lengths_minimum_and_zero_ratio() -> None:
    rng = np.random.default_rng(0)
    assert sample_lengths(rng, 9, 0.0, 5).tolist() == [9] * 5
    assert sample_lengths(rng, 1, 0.9, 50).min() >= 1
    assert sample_lengths(rng, 0, 0.0, 3, minimum=0).tolist() == [0, 0, 0]


def test_prefix_requests_share_their_prefixes() -> None:
    reqs = sample_prefix(12, prefix_len=40, suffix_len=6, output_len=9, vocab_size=300,
                         num_prefixes=3, seed=1)
    assert len(reqs) == 12
    prefixes: dict[tuple[int, ...], int] = {}
    for r in reqs:
        ids = r.prompt_token_ids
        assert ids is not None
        assert r.prompt_len == len(ids) == 46 and r.output_len == 9
        assert all(0 <= t < 300 for t in ids)
        prefixes[ids[:40]] = prefixes.get(ids[:40], 0) + 1
    # Three distinct prefixes, dealt round-robin: four requests each.
    assert sorted(prefixes.values()) == [4, 4, 4]
    assert sample_prefix(12, 40, 6, 9, 300, 3, seed=1) == reqs


def test_prefix_without_suffix_and_with_ratio() -> None:
    reqs = sample_prefix(5, prefix_len=8, suffix_len=0, output_len=3, vocab_size=20, seed=0)
    assert len({r.prompt_token_ids for r in reqs}) == 1
    assert all(r.prompt_len == 8 for r in reqs)
    spread = sample_prefix(50, prefix_len=8, suffix_len=10, output_len=4, vocab_size=20,
                           range_ratio=0.5, seed=0)
    assert {r.prompt_len for r in spread} <= set(range(8 + 5, 8 + 16))


@pytest.mark.parametrize("kwargs, message", [
    (dict(input_len=0), "input length"),
    (dict(output_len=0), "output length"),
    (dict(range_ratio=1.0), "range ratio"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(num_requests=-1), "num_requests"),
])
def test_random_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    args = dict(num_requests=2, input_len=4, output_len=4, vocab_size=10, range_ratio=0.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        sample_random(**args)


def test_prefix_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_prefixes"):
        sample_prefix(2, 4, 4, 4, 10, num_prefixes=0)
    with pytest.raises(ValueError, match="add up to 0"):
        sample_prefix(2, 0, 0, 4, 10)


def _args(**overrides: object) -> argparse.Namespace:
    base = dict(dataset="random", num_prompts=3, seed=0, dataset_path=None,
                sharegpt_output_len=None, random_input_len=6, random_output_len=2,
                random_range_ratio=0.0, prefix_len=5, num_prefixes=1, prefix_suffix_len=1)
    base.update(overrides)
    return argparse.Namespace(**base)


def test_build_requests_from_flags() -> None:
    assert build_requests(_args(), None, 100) == sample_random(3, 6, 2, 100, 0.0, 0)
    prefix = build_requests(_args(dataset="prefix"), None, 100)
    assert [r.prompt_len for r in prefix] == [6, 6, 6]
    with pytest.raises(ValueError, match="tokenizer"):
        build_requests(_args(dataset="sharegpt"), None, 100)
    with pytest.raises(ValueError, match="num-prompts"):
        build_requests(_args(num_prompts=0), None, 100)
