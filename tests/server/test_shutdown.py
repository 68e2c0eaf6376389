"""SIGTERM/SIGINT drain the server: new requests get 503 + Retry-After and /health 503 at
once, running requests finish, and at --shutdown-timeout the ones left are ended with an
OpenAI error (a stream: an error event, then [DONE]). Every request gets an answer; the
process exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

from tests.server.conftest import TINY_ARGS, TINY_NAME, ServerProcess, metric_value

httpx = pytest.importorskip("httpx")


class Call(threading.Thread):
    """One completion request on its own thread, recording what came back."""

    def __init__(self, url: str, stream: bool, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.stream = url, stream
        self.body = {"model": TINY_NAME, "prompt": "Once upon a time", "max_tokens": max_tokens,
                     "ignore_eos": True, "stream": stream}
        self.status: int | None = None
        self.events: list[str] = []
        self.json: dict | None = None
        self.started = threading.Event()  # the 200 and a first chunk, or the answer
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=120) as http:
                if self.stream:
                    with http.stream("POST", "/v1/completions", json=self.body) as r:
                        self.status = r.status_code
                        for line in r.iter_lines():
                            if line.startswith("data: "):
                                self.events.append(line[len("data: "):])
                                self.started.set()
                else:
                    r = http.post("/v1/completions", json=self.body)
                    self.status, self.json = r.status_code, r.json()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.started.set()

    def stream_payloads(self) -> list[dict]:
        assert self.events and self.events[-1] == "[DONE]", self.events[-3:]
        return [json.loads(e) for e in self.events[:-1]]


def _start(tmp_path, model_dir: str, *extra: str) -> ServerProcess:
    return ServerProcess([model_dir, "--served-model-name", TINY_NAME, *TINY_ARGS, *extra],
                         tmp_path / "server.log")


def _assert_turned_away(url: str) -> None:
    with httpx.Client(base_url=url, timeout=10) as http:
        r = http.post("/v1/completions", json={"model": TINY_NAME, "prompt": "Hi",
                                               "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "server_shutting_down"
        assert int(r.headers["retry-after"]) > 0
        health = http.get("/health")
        assert health.status_code == 503
        assert health.json()["error"]["code"] == "server_shutting_down"
        assert http.get("/metrics").status_code == 200  # scrapes still see the drain


def _accepted(url: str) -> float:
    """Sequences the engine took: running, waiting or finished, from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    finished = sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                   if line.startswith("pagedlm:request_success_total{"))
    return (metric_value(text, "pagedlm:num_requests_running")
            + metric_value(text, "pagedlm:num_requests_waiting") + finished)


def _sigterm_with_calls_in_flight(server: ServerProcess, num_calls: int,
                                  max_tokens: int) -> list[Call]:
    """Start the calls (streamed and not, alternately), SIGTERM the server once the first
    is streaming and the rest are queued, and check it turns new work away at once."""
    server.wait_healthy()
    calls = [Call(server.url, stream=i % 2 == 0, max_tokens=max_tokens)
             for i in range(num_calls)]
    for call in calls:
        call.start()
    assert calls[0].started.wait(60), server.log()
    # Every call is in the engine (running, queued or done) before the signal: a call that
    # arrived after it would rightly be turned away, which is not what is tested.
    deadline = time.monotonic() + 60
    while _accepted(server.url) < num_calls:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    _assert_turned_away(server.url)
    return calls


def test_sigterm_lets_running_requests_finish(tmp_path, tiny_model_dir):
    # One sequence at a time: the drain waits for the running request and the queued ones.
    server = _start(tmp_path, tiny_model_dir, "--shutdown-timeout", "60", "--max-num-seqs", "1")
    try:
        calls = _sigterm_with_calls_in_flight(server, num_calls=6, max_tokens=900)
        for call in calls:
            call.join(120)
            assert call.error is None, call.error
            assert call.status == 200
            if call.stream:
                payloads = call.stream_payloads()
                assert not any("error" in p for p in payloads), payloads[-2:]
                assert payloads[-1]["choices"][0]["finish_reason"] == "length"
            else:
                assert call.json["choices"][0]["finish_reason"] == "length"
                assert call.json["usage"]["completion_tokens"] == 900
        assert server.proc.wait(60) == 0, server.log()
        assert "drained: every request finished" in server.log()
    finally:
        server.stop()


def test_shutdown_timeout_ends_the_requests_left_with_an_answer(tmp_path, tiny_model_dir):
    # One sequence at a time: at the deadline one request runs and the others wait.
    server = _start(tmp_path, tiny_model_dir, "--shutdown-timeout", "0.5",
                    "--max-num-seqs", "1")
    try:
        calls = _sigterm_with_calls_in_flight(server, num_calls=20, max_tokens=1000)
        ended = 0  # the requests still running or queued at the deadline (20,000 tokens)
        for call in calls:
            call.join(60)
            assert not call.is_alive() and call.error is None, call.error
            if call.stream:
                assert call.status == 200
                last = call.stream_payloads()[-1]
                if "error" not in last:  # it finished before the deadline
                    assert last["choices"][0]["finish_reason"] == "length"
                    continue
                error = last["error"]
            else:
                if call.status == 200:
                    assert call.json["usage"]["completion_tokens"] == 1000
                    continue
                assert call.status == 503, call.json
                error = call.json["error"]
            assert error["code"] == "server_shutting_down", error
            assert "shutdown timeout" in error["message"]
            ended += 1
        assert ended >= 2, [c.status for c in calls]
        assert server.proc.wait(60) == 0, server.log()
        assert "shutdown timeout: ended" in server.log()
    finally:
        server.stop()


@pytest.mark.parametrize("busy", [True, False], ids=["a-stream-running", "idle"])
def test_a_second_signal_stops_at_once_without_a_traceback(tmp_path, tiny_model_dir, busy):
    """Ctrl-C twice (or SIGTERM twice): the drain is cut short, the process and its engine
    core exit, and the log says so in one line, with no traceback (idle, the second signal
    lands while uvicorn shuts down: its lifespan task was cancelled, which uvicorn logged
    as a failed shutdown with the traceback)."""
    import psutil

    server = _start(tmp_path, tiny_model_dir, "--shutdown-timeout", "60", "--max-num-seqs", "1")
    try:
        server.wait_healthy()
        children = psutil.Process(server.proc.pid).children(recursive=True)
        if busy:
            call = Call(server.url, stream=True, max_tokens=900)
            call.start()
            assert call.started.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        if busy:
            # The second signal as soon as the drain has begun: the stream of 900 tokens must
            # still be running then, and on a fast machine the tiny model finishes it in well
            # under the 0.3 s this test used to wait.
            deadline = time.monotonic() + 30
            while "SIGTERM: shutting down" not in server.log() and time.monotonic() < deadline:
                time.sleep(0.005)
        else:
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGINT if busy else signal.SIGTERM)
        server.proc.wait(60)
        log = server.log()
        assert "SIGTERM: shutting down" in log, log
        assert (f"during the drain: stopping now ({int(busy)} running request(s) cut off)"
                in log), log
        assert "Traceback" not in log and "ERROR" not in log, log
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, alive
        if busy:
            call.join(60)
            assert call.status == 200
    finally:
        server.stop()
