"""What every benchmark result JSON carries: the machine, the versions, the workload."""

from __future__ import annotations

import json
import math
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo, falling back to platform info."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(threads: int | None = None) -> dict[str, Any]:
    """CPU model, core counts and the torch intra-op threads used (``threads`` or torch's)."""
    try:
        # The cores this process may run on: what a container actually grants.
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    if threads is None:
        # Not at the top: bench plot uses this module's JSON helpers without loading torch.
        import torch

        threads = torch.get_num_threads()
    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "usable_cores": usable,
        "threads": threads,
        "python": platform.python_version(),
    }
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def versions() -> dict[str, str | None]:
    """Installed versions of pagedlm, torch, transformers and llama-cpp-python (None if
    not installed)."""
    out: dict[str, str | None] = {}
    for dist in ("pagedlm", "torch", "transformers", "llama-cpp-python"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def result_header(
    benchmark: str,
    *,
    model: str | None,
    dtype: str | None,
    dataset: str,
    num_prompts: int,
    seed: int,
    threads: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The fields every result JSON starts with; ``extra`` adds benchmark-specific ones."""
    return {
        "benchmark": benchmark,
        "model": model,
        "dtype": dtype,
        "dataset": dataset,
        "num_prompts": num_prompts,
        "seed": seed,
        "machine": machine_info(threads),
        "versions": versions(),
        **extra,
    }


def _finite(value: Any) -> Any:
    """JSON has no Infinity/NaN: write them as the strings "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(path: str | Path, report: dict[str, Any]) -> Path:
    """Write ``report`` as strict JSON (non-finite floats become strings); returns the path."""
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(report), indent=2, allow_nan=False) + "\n",
                    encoding="utf-8")
    return path


def read_json(path: str | Path) -> dict[str, Any]:
    """Load a result JSON, with a clear error when it is missing or not JSON."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"result file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"result file {str(path)!r} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"result file {str(path)!r} does not hold a JSON object")
    return data


def model_label(model: str | None) -> str:
    """A model's name for reports: the path given, or the embedded default's file name."""
    return model if model is not None else "SmolLM2-135M-Instruct.Q4_1.gguf (embedded default)"
