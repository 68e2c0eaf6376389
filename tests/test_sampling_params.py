import pytest

from pagedlm.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingType


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.seed is None and p.max_tokens == 16 and p.min_tokens == 0
    assert p.stop == [] and p.stop_token_ids == []
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.detokenize and p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.sampling_type == SamplingType.RANDOM and not p.is_greedy
    assert MAX_LOGPROBS == 20


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"n": True}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.01}, "min_p"),
        ({"presence_penalty": 2.1}, "presence_penalty"),
        ({"presence_penalty": -2.1}, "presence_penalty"),
        ({"frequency_penalty": 2.1}, "frequency_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
        ({"stop": "x", "detokenize": False}, "detokenize"),
    ],
)
def test_validation_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_limits_in_messages() -> None:
    with pytest.raises(ValueError, match=r"\[0, 20\]"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_boundaries_accepted() -> None:
    SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=2, frequency_penalty=-2)
    SamplingParams(logprobs=0, prompt_logprobs=MAX_LOGPROBS)
    SamplingParams(min_tokens=16, max_tokens=16)
    SamplingParams(max_tokens=None, min_tokens=1000)
    SamplingParams(seed=-5)
    SamplingParams(seed=2**80)
    SamplingParams(detokenize=False)


def test_normalisation() -> None:
    p = SamplingParams(top_k=-1, stop="END", stop_token_ids=(3, 4), temperature=1)
    assert p.top_k == 0
    assert p.stop == ["END"] and p.stop_token_ids == [3, 4]
    assert isinstance(p.temperature, float)
    assert p.max_stop_str_len == 3
    assert SamplingParams(stop=["a", "abcd", "ab"]).max_stop_str_len == 4
    assert SamplingParams().max_stop_str_len == 0


def test_greedy_and_sampling_type() -> None:
    assert SamplingParams(temperature=0).is_greedy
    # vLLM's threshold: below 1e-5 is greedy, tiny temperatures above it are kept.
    assert SamplingParams(temperature=9e-6).sampling_type == SamplingType.GREEDY
    tiny = SamplingParams(temperature=1e-3)
    assert not tiny.is_greedy and tiny.temperature == 1e-3
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    # top-p/k/min-p cannot change an argmax, so greedy resets them.
    g = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2)
    assert (g.top_p, g.top_k, g.min_p) == (1.0, 0, 0.0)


def test_clone_is_deep() -> None:
    p = SamplingParams(stop=["x"], stop_token_ids=[1], seed=7)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")
    q.stop_token_ids.append(2)
    assert p.stop == ["x"] and p.stop_token_ids == [1]
