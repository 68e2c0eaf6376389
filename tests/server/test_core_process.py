"""The engine core runs in a process of its own under `pagedlm serve`; when it dies the
server reports it at once (in-flight streams get an error event, new requests a 503,
/health a 503) and then exits by itself, leaving no process behind."""

from __future__ import annotations

import json
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
