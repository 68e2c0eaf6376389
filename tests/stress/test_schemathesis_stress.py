"""Schemathesis over every operation of our own /openapi.json: its coverage cases
(boundaries, wrong types, unexpected methods; a fixed set, ~1,500), then
PAGEDLM_STRESS_CASES generated cases (default 1200) that fit the schema or violate it,
split across the operations and modes. The rules are tests/server/test_fuzz.py's (tests/server/fuzz_rules.py):
no 5xx, a schema-violating request gets a 4xx, a schema-valid one a 2xx or one of the
listed cross-field 400s.

Problems are collected, not raised at once, so one run finds every kind; a server that
dies is recorded and restarted. PAGEDLM_STRESS_SEED fixes the generation (the seed used
is in the figures)."""

from __future__ import annotations

import random
import time

import pytest

schemathesis = pytest.importorskip("schemathesis")
import hypothesis  # noqa: E402
import requests  # noqa: E402
from hypothesis import HealthCheck, Phase, Verbosity, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from tests.server.conftest import TINY_ARGS, TINY_NAME, ServerProcess  # noqa: E402
from tests.server.fuzz_rules import Tally, bound_generation, judge  # noqa: E402
from tests.stress.conftest import env_int  # noqa: E402

MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
MAX_RESTARTS = 5
MAX_ROUNDS = 5  # fuzzing rounds to reach the total when operations run out of new cases


class FuzzServer:
    """A `pagedlm serve` with the tiny model, no API key; started again if it dies."""

    def __init__(self, tmp_path_factory, model_dir: str) -> None:
        self.factory = tmp_path_factory
        # A queue bound of 256 sequences: 64 prompts x n=16 goes over it (a listed 400).
        self.args = [model_dir, *TINY_ARGS, "--served-model-name", TINY_NAME, "alias",
                     "--max-request-body-size", "256K", "--max-num-seqs", "64",
                     "--max-num-queued-requests", "256"]
        self.restarts = 0
        self.server = self._start()

    def _start(self) -> ServerProcess:
        server = ServerProcess(self.args, self.factory.mktemp("server-schemathesis") / "log")
        server.wait_healthy()
        return server

    @property
    def url(self) -> str:
        return self.server.url

    def healthy(self) -> bool:
        if self.server.proc.poll() is not None:
            return False
        try:
            return requests.get(f"{self.url}/health", timeout=10).status_code == 200
        except requests.RequestException:
            return False

    def restart(self) -> str:
        """Start a new server; the old one's log tail."""
        log = self.server.log()[-2000:]
        self.server.stop()
        self.restarts += 1
        if self.restarts > MAX_RESTARTS:
            pytest.fail(f"the server died {self.restarts} times; last log:\n{log}")
        self.server = self._start()
        return log

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, tiny_model_dir):
    server = FuzzServer(tmp_path_factory, tiny_model_dir)
    yield server
    server.stop()


class Run:
    """Executes cases against the server and keeps the tally."""

    def __init__(self, server: FuzzServer) -> None:
        self.server = server
        self.tally = Tally()
        self.no_answer = 0

    def execute(self, label: str, case) -> None:
        bound_generation(case)
        try:
            response = case.call(base_url=self.server.url, timeout=120)
        except requests.RequestException as e:
            self.no_answer += 1
            self.tally.add_problem(f"{label}: no answer ({type(e).__name__})",
                                   f"{case.method} {case.formatted_path}: {e}; body: "
                                   f"{str(case.body)[:600]}")
            self._check_alive(label, case)
            return
        verdict = judge(case, response)
        self.tally.add(label, case, response, verdict)
        if verdict.status >= 500:
            self._check_alive(label, case)

    def _check_alive(self, label: str, case) -> None:
        if not self.server.healthy():
            log = self.server.restart()
            self.tally.add_problem(f"{label}: the server died", f"after body "
                                   f"{str(case.body)[:600]}\n  server log:\n{log}")

    def coverage(self, schema, operation) -> int:
        config = schema.config.generation_for(operation=operation, phase="coverage")
        count = 0
        for case in schema.iter_coverage_cases(operation, generation_modes=list(MODES),
                                               generation_config=config):
            self.execute(operation.label, case)
            count += 1
        return count

    def fuzz(self, operation, mode: GenerationMode, quota: int, seed: int) -> int:
        """Up to `quota` generated cases (fewer if hypothesis runs out of new ones)."""
        executed = 0

        @hypothesis.seed(seed)
        @settings(max_examples=quota, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet)
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case) -> None:
            nonlocal executed
            if executed < quota:
                executed += 1
                self.execute(operation.label, case)

        try:
            run()
        except Unsatisfiable:  # no case of this mode exists (a GET without parameters)
            pass
        return executed


def test_schemathesis_every_operation(fuzz_server, report):
    total = env_int("PAGEDLM_STRESS_CASES", 1200)
    seed = env_int("PAGEDLM_STRESS_SEED", random.randrange(2**32))
    started = time.monotonic()
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json", timeout=30)
    operations = []
    for result in schema.get_all_operations():
        operations.append(result.ok())  # raises on an operation schemathesis cannot test
    assert len(operations) >= 10, [op.label for op in operations]
    run = Run(fuzz_server)

    coverage_cases = sum(run.coverage(schema, op) for op in operations)
    # Operations without a body first: they run out of new cases early and leave the
    # rest of their share to the ones with bodies.
    slots = sorted(((op, mode) for op in operations for mode in MODES),
                   key=lambda slot: (len(slot[0].body) > 0,
                                     slot[0].label, slot[1].value))
    fuzz_target = max(total, len(slots))
    fuzz_cases = 0
    for round_ in range(MAX_ROUNDS):
        active = list(slots)
        added = 0
        for i, (op, mode) in enumerate(active):
            left = fuzz_target - fuzz_cases
            if left <= 0:
                break
            quota = -(-left // (len(active) - i))
            executed = run.fuzz(op, mode, quota, seed + 1000 * round_ + i)
            fuzz_cases += executed
            added += executed
            if executed < quota:  # exhausted: no more rounds for it
                slots.remove((op, mode))
        if fuzz_cases >= fuzz_target or not added or not slots:
            break

    tally = run.tally
    figures = dict(
        cases=tally.cases, positive=tally.positive, negative=tally.negative,
        status_counts=dict(sorted(tally.status_counts.items())),
        coverage_cases=coverage_cases, fuzz_cases=fuzz_cases, requested=total, seed=seed,
        operations=len(operations), per_operation=dict(sorted(tally.per_operation.items())),
        allowed_400s=dict(tally.allowed_400s.most_common()), no_answer=run.no_answer,
        server_restarts=fuzz_server.restarts, problems=sum(tally.problem_counts.values()),
        problem_kinds=len(tally.problem_counts),
        seconds=round(time.monotonic() - started, 1))
    report(**figures)
    assert set(tally.per_operation) == {op.label for op in operations}, figures
    assert fuzz_cases >= total, figures  # the figure is real: generated cases sent
    assert tally.cases + run.no_answer == coverage_cases + fuzz_cases, figures
    assert tally.positive and tally.negative, figures
    assert figures["problems"] == 0, tally.problems()
