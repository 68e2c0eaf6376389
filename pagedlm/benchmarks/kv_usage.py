"""The KV waste figures of `pagedlm bench kv-waste`: the simulation of paged and contiguous
allocation (documented in kv_waste.py) and the same figures from an engine's recording.

Pure numpy, so that `pagedlm bench plot` reads kv-waste results without loading the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

RESERVE_MAX = "reserve_max_model_len"
RESERVE_ORACLE = "reserve_oracle"
MAX_SERIES_POINTS = 1000


def paged_key(block_size: int) -> str:
    return f"paged_bs{block_size}"


def _downsample(num: int, max_points: int) -> np.ndarray:
    """Indices of at most ``max_points`` evenly spread steps, first and last included."""
    if num <= max_points:
        return np.arange(num)
    return np.unique(np.linspace(0, num - 1, max_points).round().astype(np.int64))


def _waste_figures(tokens: np.ndarray, allocated: np.ndarray) -> tuple[float, float]:
    """(slot-step waste, mean per-step waste) over steps with any slot allocated."""
    used = allocated > 0
    tokens, allocated = tokens[used], allocated[used]
    if allocated.size == 0:
        return float("nan"), float("nan")
    waste = 1.0 - float(tokens.sum()) / float(allocated.sum())
    mean_step = float(np.mean(1.0 - tokens / allocated))
    return waste, mean_step


def simulate_kv_usage(
    lengths: Sequence[tuple[int, int]],
    block_sizes: Sequence[int],
    max_model_len: int,
    max_num_seqs: int | None = None,
    max_series_points: int = MAX_SERIES_POINTS,
) -> dict[str, Any]:
    """Simulate the requests' lifetimes (see the module docstring) and report the waste of
    each allocation scheme.  ``lengths`` holds (prompt_len, output_len) per request;
    ``max_num_seqs`` None admits every request at once."""
    if not lengths:
        raise ValueError("the trace has no requests")
    if any(b < 1 for b in block_sizes) or not block_sizes:
        raise ValueError(f"block sizes must be >= 1, got {list(block_sizes)}")
    prompt = np.array([p for p, _ in lengths], dtype=np.int64)
    output = np.array([o for _, o in lengths], dtype=np.int64)
    if (prompt < 1).any() or (output < 1).any():
        raise ValueError("every request needs at least one prompt and one output token")
    longest = int((prompt + output).max())
    if longest > max_model_len:
        raise ValueError(f"a request needs {longest} tokens, more than max_model_len "
                         f"({max_model_len}) reserves")
    cap = len(lengths) if max_num_seqs is None else max_num_seqs
    if cap < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")

    schemes = [paged_key(b) for b in block_sizes] + [RESERVE_MAX, RESERVE_ORACLE]
    held: list[int] = []
    running: list[int] = []
    allocated: dict[str, list[int]] = {s: [] for s in schemes}
    live = np.empty(0, dtype=np.int64)  # request indices
    age = np.empty(0, dtype=np.int64)  # steps each live request has run, after this step
    next_req = 0
    while next_req < len(lengths) or live.size:
        admit = min(cap - live.size, len(lengths) - next_req)
        if admit > 0:
            live = np.concatenate([live, np.arange(next_req, next_req + admit)])
            age = np.concatenate([age, np.zeros(admit, dtype=np.int64)])
            next_req += admit
        age += 1
        tokens = prompt[live] + age - 1  # [num_live]
        held.append(int(tokens.sum()))
        running.append(int(live.size))
        for b in block_sizes:
            allocated[paged_key(b)].append(int((-(-tokens // b) * b).sum()))
        allocated[RESERVE_MAX].append(int(live.size) * max_model_len)
        allocated[RESERVE_ORACLE].append(int((prompt[live] + output[live]).sum()))
        keep = age < output[live]
        live, age = live[keep], age[keep]

    held_arr = np.array(held, dtype=np.float64)
    waste: dict[str, float] = {}
    mean_step: dict[str, float] = {}
    for s in schemes:
        waste[s], mean_step[s] = _waste_figures(held_arr, np.array(allocated[s], dtype=np.float64))
    keep_idx = _downsample(len(held), max_series_points)
    series: dict[str, list[int]] = {
        "step": (keep_idx + 1).tolist(),
        "tokens_held": [held[i] for i in keep_idx],
        "num_running": [running[i] for i in keep_idx],
    }
    for s in schemes:
        series[s] = [allocated[s][i] for i in keep_idx]
    return {
        "num_requests": len(lengths),
        "num_steps": len(held),
        "max_num_seqs": max_num_seqs,
        "max_model_len": max_model_len,
        "token_steps": int(held_arr.sum()),
        "allocated_slot_steps": {s: int(sum(allocated[s])) for s in schemes},
        "waste": waste,
        "mean_step_waste": mean_step,
        "series": series,
    }


def measured_waste(samples: Sequence[Any], max_series_points: int = MAX_SERIES_POINTS
                   ) -> dict[str, Any]:
    """Waste from an engine's ``kv_usage`` recording (:class:`KVUsageSample` objects)."""
    tokens = np.array([s.tokens_held for s in samples], dtype=np.float64)
    allocated = np.array([s.allocated_slots for s in samples], dtype=np.float64)
    waste, mean_step = _waste_figures(tokens, allocated)
    keep_idx = _downsample(len(samples), max_series_points)
    return {
        "num_steps": len(samples),
        "waste": waste,
        "mean_step_waste": mean_step,
        "peak_allocated_slots": int(allocated.max()) if len(samples) else 0,
        "series": {
            "step": [samples[i].step for i in keep_idx],
            "allocated_slots": [samples[i].allocated_slots for i in keep_idx],
            "tokens_held": [samples[i].tokens_held for i in keep_idx],
            "num_running": [samples[i].num_running for i in keep_idx],
        },
    }


_LABELS = {RESERVE_MAX: "contiguous, reserve max_model_len",
           RESERVE_ORACLE: "contiguous, reserve prompt+max_tokens"}


def format_table(sim: dict[str, Any], measured: dict[str, dict[str, Any]] | None = None) -> str:
    """A text table of the waste figures (percent)."""
    lines = [f"{'allocation':<40}{'waste':>9}{'per-step':>10}"]
    for key, waste in sim["waste"].items():
        label = _LABELS.get(key, key.replace("paged_bs", "paged, block size "))
        lines.append(f"{label:<40}{waste:>9.1%}{sim['mean_step_waste'][key]:>10.1%}")
    for bs, m in (measured or {}).items():
        label = f"measured engine, block size {bs}"
        lines.append(f"{label:<40}{m['waste']:>9.1%}{m['mean_step_waste']:>10.1%}")
    return "\n".join(lines)
