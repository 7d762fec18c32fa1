"""`arbor serve` under SIGTERM, as a real process: the first signal stops admitting, lets running
requests go on for the grace period, aborts them (the stream ends with finish_reason "abort" and
[DONE]) and exits 0; a second signal exits at once."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server_helpers import free_port, tiny_folder

STREAM = {"model": "tiny", "prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "temperature": 0, "stream": True}


def start(folder, grace: float, log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "arbor.cli", "serve", str(folder), "--port", str(port), "engine.max_model_len=4096",
           "--served-model-name", "tiny", f"server.shutdown_grace_s={grace}"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc, url: str, deadline: float = 90) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline:
        assert proc.poll() is None, "the server exited while starting"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not start")


class Reader(threading.Thread):
    """Reads one long stream; records the events and when the stream ended."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.events, self.done, self.ended, self.error = url, [], False, None, None
        self.started = threading.Event()

    def run(self):
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=STREAM, timeout=60) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
                        if len(self.events) == 5:
                            self.started.set()
        except httpx.TransportError as e:       # a server that exits at once cuts the stream
            self.error = e
        self.ended = time.monotonic()


@pytest.fixture
def servers(tmp_path):
    folder = tiny_folder(tmp_path / "tiny")
    procs = []
    with open(tmp_path / "graceful.log", "w") as a, open(tmp_path / "forced.log", "w") as b:
        procs = [start(folder, 1.5, a), start(folder, 60, b)]
        try:
            for proc, url in procs:
                wait_ready(proc, url)
            yield procs
        finally:
            for proc, _ in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def test_sigterm_grace_then_abort_and_a_second_sigterm_exits_at_once(servers):
    (graceful, url), (forced, url2) = servers
    readers = [Reader(url), Reader(url2)]
    for r in readers:
        r.start()
        assert r.started.wait(30)

    t0 = time.monotonic()
    graceful.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.TransportError):           # no longer admitting
        httpx.get(url + "/health", timeout=2)
    assert readers[0].is_alive(), "the grace period was not given"
    assert graceful.wait(timeout=10) == 0
    readers[0].join(5)
    assert readers[0].error is None and readers[0].done
    assert readers[0].events[-1]["choices"][0]["finish_reason"] == "abort"
    assert 1.3 < readers[0].ended - t0 < 4.5, readers[0].ended - t0
    assert 5 < len(readers[0].events) < STREAM["max_tokens"]

    t1 = time.monotonic()
    forced.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    forced.send_signal(signal.SIGTERM)
    assert forced.wait(timeout=10) == 0
    assert time.monotonic() - t1 < 3.0, time.monotonic() - t1
    readers[1].join(5)
    assert not readers[1].is_alive()
