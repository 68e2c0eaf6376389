"""User-facing sampling knobs and their validation.

Names, defaults and meanings follow vLLM's `SamplingParams` so that client code
written against it keeps working. This module deliberately does not import torch:
the API server validates requests with it before anything touches the model.

Every invalid value raises `ValueError` whose message names the field and the
limit that was broken.
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass
from enum import IntEnum

from pagedlm.structured import StructuredOutputsParams

# Most top logprobs a request may ask for, per generated or prompt token.
MAX_LOGPROBS = 20
MAX_BEAM_WIDTH = 64
# Penalties live in [-MAX_PENALTY, MAX_PENALTY], as in the OpenAI API.
MAX_PENALTY = 2.0
# Beyond these, float32 logits overflow (a temperature past 3.4e38 is inf, logits divided by
# a repetition penalty of 1e-300 are inf) or beam scores do (len ** 1e308): the sampler would
# pick outside a grammar's mask and beam search would crash. Far past any useful value.
MAX_TEMPERATURE = 100.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_LENGTH_PENALTY = 10.0
# Like vLLM, a temperature below this counts as greedy: dividing logits by such a
# tiny number only amplifies float noise, and the result is argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _as_int(name: str, value: object) -> int:
    # bool is an Integral, but `top_k=True` is a bug in the caller, not a number.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return int(value)


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


@dataclass
class SamplingParams:
    """How to sample the continuation of one prompt.

    After construction the fields are normalised: `stop` and `stop_token_ids` are
    lists, `top_k` is 0 when disabled (-1 is accepted as an alias), numeric fields
    have their plain Python types, and for greedy requests (temperature below
    `GREEDY_TEMPERATURE_EPS`) top_p/top_k/min_p are reset to their neutral values
    because they cannot change an argmax.
    """

    n: int = 1
    # Generate best_of samples and return the n with the highest cumulative logprob.
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # Any int; the sampler reduces it modulo 2**63.
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # None means "up to the model's context length"; the engine fills it in.
    max_tokens: int | None = 16
    min_tokens: int = 0
    # Number of top logprobs per generated token; 0 returns only the sampled one.
    logprobs: int | None = None
    # The same for each prompt token.
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Beam search through the generate/serving path (vLLM's extra parameters): the beam
    # width is best_of or n; the n best beams are returned.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Constrain the output to a JSON schema, regex, choice or grammar (pagedlm.structured).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.n = _as_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.best_of is not None:
            self.best_of = _as_int("best_of", self.best_of)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")

        self.temperature = _as_float("temperature", self.temperature)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got "
                             f"{self.temperature}")

        self.top_p = _as_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

        self.top_k = _as_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0

        self.min_p = _as_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}")
            setattr(self, name, value)

        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty must be in [{low:g}, {high:g}], got "
                             f"{self.repetition_penalty}")

        if self.seed is not None:
            self.seed = _as_int("seed", self.seed)

        if self.max_tokens is not None:
            self.max_tokens = _as_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

        self.min_tokens = _as_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            value = _as_int(name, value)
            if not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
            setattr(self, name, value)

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        if self.stop and not self.detokenize:
            # Stop strings are matched on detokenized text; without it they could
            # never fire and the request would silently run to max_tokens.
            raise ValueError("stop strings require detokenize=True (got detokenize=False)")

        if not isinstance(self.use_beam_search, bool):
            raise ValueError(f"use_beam_search must be a bool, got {self.use_beam_search!r}")
        self.length_penalty = _check_length_penalty(self.length_penalty)
        if self.use_beam_search:
            if self.max_tokens is None:
                raise ValueError("max_tokens must be set when use_beam_search is true")
            if self.stop or self.min_tokens or self.logprobs is not None or self.prompt_logprobs is not None:
                raise ValueError("use_beam_search does not combine with stop strings, min_tokens "
                                 "or logprobs")
            if (self.best_of or self.n) > MAX_BEAM_WIDTH:
                raise ValueError(f"beam width (best_of or n) must be <= {MAX_BEAM_WIDTH}, got "
                                 f"{self.best_of or self.n}")

        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}")
            if self.use_beam_search:
                raise ValueError("use_beam_search does not combine with structured_outputs")

        if self.is_greedy:
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    @staticmethod
    def _normalise_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, list | tuple):
            raise ValueError(f"stop must be a str or a list of str, got {stop!r}")
        out: list[str] = []
        for s in items:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only str, got {s!r}")
            if not s:
                raise ValueError("stop strings must be non-empty (length >= 1), got ''")
            out.append(s)
        return out

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, list | tuple):
            raise ValueError(f"stop_token_ids must be a list of int, got {ids!r}")
        out: list[int] = []
        for t in ids:
            t = _as_int("stop_token_ids", t)
            if t < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {t}")
            out.append(t)
        return out

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def max_stop_str_len(self) -> int:
        """Length of the longest stop string (0 if none).

        A streaming detokenizer must hold back this many characters minus one:
        they may be the start of a stop string that is completed later.
        """
        assert isinstance(self.stop, list)  # normalised in __post_init__
        return max((len(s) for s in self.stop), default=0)

    def clone(self) -> SamplingParams:
        """A deep copy, so that per-request changes (e.g. n>1 child seeds, the
        engine filling in max_tokens) never leak into the caller's object."""
        return copy.deepcopy(self)


def _check_length_penalty(value: object) -> float:
    value = _as_float("length_penalty", value)
    if not -MAX_LENGTH_PENALTY <= value <= MAX_LENGTH_PENALTY:
        raise ValueError(f"length_penalty must be in [-{MAX_LENGTH_PENALTY:g}, "
                         f"{MAX_LENGTH_PENALTY:g}], got {value}")
    return value


@dataclass
class BeamSearchParams:
    """Beam search, vLLM's `BeamSearchParams`: `beam_width` beams, each step keeping the
    best continuations by cumulative logprob; finished beams are ranked by
    cum_logprob / generated_len ** length_penalty (HF transformers' scoring)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        self.beam_width = _as_int("beam_width", self.beam_width)
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}")
        self.max_tokens = _as_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        self.temperature = _as_float("temperature", self.temperature)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got "
                             f"{self.temperature}")
        self.length_penalty = _check_length_penalty(self.length_penalty)
