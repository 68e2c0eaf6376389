"""The engine core runs in a process of its own under `pagedlm serve`; when it dies the
server reports it at once (in-flight streams get an error event, new requests a 503,
/health a 503) and then exits by itself, leaving no process behind."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from tests.server.conftest import TINY_ARGS, TINY_NAME, ServerProcess

psutil = pytest.importorskip("psutil")


def _core_process(server: ServerProcess):
    """The server's engine core: its multiprocessing child running the core loop."""
    children = psutil.Process(server.proc.pid).children()
    cores = [c for c in children if any("spawn_main" in part for part in c.cmdline())]
    assert len(cores) == 1, [c.cmdline() for c in children]
    return cores[0]


def test_core_death_is_reported_and_the_server_exits(tmp_path, tiny_model_dir):
    import httpx

    server = ServerProcess([tiny_model_dir, *TINY_ARGS, "--served-model-name", TINY_NAME],
                           tmp_path / "server.log")
    try:
        server.wait_healthy()
        core = _core_process(server)
        assert core.pid != server.proc.pid
        # The frontend yields the CPU to the core's compute threads.
        assert psutil.Process(server.proc.pid).nice() == core.nice() + 10

        # The core really does the model work: a completion runs while it is alive.
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post("/v1/completions", json={"model": TINY_NAME, "prompt": "Hello",
                                                   "max_tokens": 4})
            assert r.status_code == 200, r.text

        # A long stream in flight when the core dies.
        events: list[str] = []
        first_chunk = threading.Event()

        def stream() -> None:
            body = {"model": TINY_NAME, "prompt": "Once upon a time", "max_tokens": 900,
                    "ignore_eos": True, "stream": True}
            with httpx.Client(base_url=server.url, timeout=60) as http, \
                    http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        first_chunk.set()

        streamer = threading.Thread(target=stream)
        streamer.start()
        assert first_chunk.wait(60), server.log()
        core.kill()
        streamer.join(60)
        assert not streamer.is_alive()
        errors = [json.loads(e) for e in events if e != "[DONE]" and "error" in json.loads(e)]
        assert errors and errors[-1]["error"]["code"] == "engine_dead", events[-3:]

        # Until it exits, the server says why it is going.
        with httpx.Client(base_url=server.url, timeout=10) as http:
            health = http.get("/health")
            assert health.status_code == 503
            assert health.json()["error"]["code"] == "engine_dead"
            r = http.post("/v1/completions", json={"model": TINY_NAME, "prompt": "Hi",
                                                   "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"

        assert server.proc.wait(30) == 1, server.log()
        said = [line for line in server.log().splitlines() if "engine core" in line]
        assert any("engine core process was killed by signal 9" in line for line in said), said
        time.sleep(0.5)
        assert not psutil.pid_exists(core.pid) or \
            psutil.Process(core.pid).status() == psutil.STATUS_ZOMBIE
    finally:
        server.stop()


def test_sigint_stops_the_core_with_the_server(tmp_path, tiny_model_dir):
    server = ServerProcess([tiny_model_dir, *TINY_ARGS, "--served-model-name", TINY_NAME],
                           tmp_path / "server.log")
    try:
        server.wait_healthy()
        core = _core_process(server)
    finally:
        server.stop()
    assert server.proc.returncode in (0, 130), server.log()  # 130: uvicorn re-raises SIGINT
    assert "did not stop" not in server.log()
    core.wait(10)  # gone (reaped by the server before it exited)
    assert not psutil.pid_exists(core.pid)


def test_a_busy_port_is_an_error_before_the_model_loads(tiny_model_dir):
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "pagedlm.entrypoints.cli", "serve", tiny_model_dir,
             *TINY_ARGS, "--host", "127.0.0.1", "--port", str(port)],
            capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "--port" in done.stderr
    assert "KV blocks" not in done.stderr  # nothing was loaded


def _processes_marked(mark: str) -> list:
    """Live processes whose environment carries PAGEDLM_TEST_MARK=mark (a server started
    with it, and every process it started: they inherit it, orphans included)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("PAGEDLM_TEST_MARK") == mark and proc.status() != "zombie":
                found.append(proc)
        except psutil.Error:
            pass
    return found


@pytest.mark.parametrize("case", ["no tokenizer", "bad --lora-modules"])
def test_an_error_after_the_core_started_stops_it(case, tiny_llama_dir):
    """`pagedlm serve` starts the core's process before it loads the tokenizer and the
    server: an error there is one line, exit status 2, and the core goes with it."""
    import os
    import subprocess
    import sys
    import uuid

    mark = uuid.uuid4().hex
    extra = {"no tokenizer": [],
             "bad --lora-modules": ["--skip-tokenizer-init", "--enable-lora",
                                    "--lora-modules", "no-equals-sign"]}[case]
    done = subprocess.run(
        [sys.executable, "-m", "pagedlm.entrypoints.cli", "serve", tiny_llama_dir,
         *TINY_ARGS, *extra, "--host", "127.0.0.1", "--port", "0"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PAGEDLM_TEST_MARK": mark})
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    expected = {"no tokenizer": "error: No tokenizer files in",
                "bad --lora-modules": "error: --lora-modules entries are name=path"}[case]
    assert last.startswith(expected), done.stderr
    assert "Traceback" not in done.stderr and "did not stop" not in done.stderr
    deadline = time.monotonic() + 10
    while _processes_marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_marked(mark) == []


def test_serve_starts_the_core_before_its_heavy_imports() -> None:
    """`pagedlm serve` starts the engine core's process from the CLI module and
    engine/core_launch.py before importing the server: neither may import torch,
    transformers or FastAPI, or the core would start only after them."""
    import subprocess
    import sys

    code = ("import sys, pagedlm.entrypoints.cli, pagedlm.engine.core_launch; "
            "print(sorted(m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_a_failed_model_fetch_lets_the_started_core_process_go(monkeypatch):
    """The core's process starts before the model is fetched (its imports and kernel build
    overlap the download): when the fetch fails, the error reaches the caller and the
    process, its pipe closed, exits on its own."""
    from pagedlm.config import EngineArgs
    from pagedlm.engine import core_launch

    launches = []
    abandon = core_launch.CoreLaunch.abandon

    def record(self, timeout: float = 5.0) -> None:
        launches.append(self)
        abandon(self, timeout)

    def no_network(model, revision=None):
        raise RuntimeError("no network to fetch the default model")

    monkeypatch.setattr(core_launch.CoreLaunch, "abandon", record)
    monkeypatch.setattr(core_launch, "local_model_path", no_network)
    with pytest.raises(RuntimeError, match="no network"):
        core_launch.launch_core(EngineArgs(model=None, device="cpu"))
    assert len(launches) == 1
    process = launches[0].process
    process.join(120)
    assert not process.is_alive() and process.exitcode == 0


@pytest.mark.parametrize("given", [None, "777"])
def test_the_core_spins_briefly_between_kernels_unless_told_otherwise(monkeypatch, given):
    """The core's process gets a short OpenMP spin (core_launch.CORE_GOMP_SPINCOUNT), or
    the user's own GOMP_SPINCOUNT; the launching process's environment is left as it was."""
    import psutil

    from pagedlm.config import EngineArgs
    from pagedlm.engine import core_launch

    if given is None:
        monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    else:
        monkeypatch.setenv("GOMP_SPINCOUNT", given)
    monkeypatch.setattr(core_launch, "local_model_path", lambda model, revision=None: model)
    launch = core_launch.launch_core(EngineArgs(model=None, device="cpu"))
    try:
        deadline = time.monotonic() + 30
        environ: dict = {}
        while "PATH" not in environ and time.monotonic() < deadline:  # empty while it execs
            environ = psutil.Process(launch.process.pid).environ()
            time.sleep(0.05)
        seen = environ.get("GOMP_SPINCOUNT")
    finally:
        launch.abandon(120)
    assert seen == (given or core_launch.CORE_GOMP_SPINCOUNT)
    assert os.environ.get("GOMP_SPINCOUNT") == given
