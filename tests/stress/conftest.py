"""The reliability suite: long, bounded load against real `pagedlm serve` processes on
127.0.0.1. Not part of the default test run (tests/conftest.py leaves this folder out
unless it is named): `python -m pytest tests/stress -q`.

Sizes and durations come from the environment, so the same tests run as a quick check
or as a long soak:
    PAGEDLM_STRESS_STREAMS   concurrent streams in the soak (default 32)
    PAGEDLM_STRESS_MINUTES   soak duration in minutes (default 3)
    PAGEDLM_STRESS_CASES     schemathesis cases over all endpoints (default 1200)
Each test prints its figures (run with -s to see them) and writes them to
$PAGEDLM_STRESS_REPORT (a JSON-lines file) when that is set.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.server.conftest import tiny_model_dir  # noqa: F401 - the shared tiny model


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


@pytest.fixture
def report(request):
    """report(**figures): print the test's figures and append them to the report file."""
    def write(**figures) -> None:
        line = {"test": request.node.name, **figures}
        print(json.dumps(line))
        path = os.environ.get("PAGEDLM_STRESS_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")

    return write
