"""Many streams against a real `toppings-serve` process: the HTTP front end must not cap the batch.

The server is the real command (flags, defaults, waitress) with each engine step slowed by a
fixed sleep (tests/server/api/slow_serve.py), so that a request of a few hundred tokens stays in
flight for seconds on the tiny model and the streams overlap. The tests check behaviour: the
running batch `/stats` reports, what each client receives, 429s, and that in-flight counts come
back to 0; never how long anything took.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import wait_healthy

REPO = Path(__file__).resolve().parents[3]
STEP_S = "0.01"  # each engine step sleeps this long first
MAX_NEW = 300  # tokens per stream: at least 3 s in flight at one step per token
NUM_CLIENTS = 64
OLD_THREAD_CAP = 16  # waitress threads of the old front end, and so its largest batch


def start_server(tmp_path: Path, model: Path, port: int, *flags: str) -> subprocess.Popen:
    log = tmp_path / f"serve_{port}.log"
    cmd = [sys.executable, "-m", "tests.server.api.slow_serve", STEP_S, "--model", str(model),
           "--port", str(port), *flags]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log)
    except BaseException:
        proc.kill()
        raise
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def default_server(tmp_path_factory, tiny_model_dir, free_port):
    """A toppings-serve with every default of the command (16 waitress threads, once)."""
    port = free_port()
    proc = start_server(tmp_path_factory.mktemp("frontend"), tiny_model_dir, port)
    yield f"http://127.0.0.1:{port}"
    stop(proc)


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory, tiny_model_dir, free_port):
    port = free_port()
    flags = ("--max-concurrent-requests", "8")
    proc = start_server(tmp_path_factory.mktemp("frontend8"), tiny_model_dir, port, *flags)
    yield f"http://127.0.0.1:{port}"
    stop(proc)


class Streamer(threading.Thread):
    """One client: a streamed /generate, read to its end; `first` is set at its first event."""

    def __init__(self, url: str, max_new: int = MAX_NEW):
        super().__init__(daemon=True)
        self.url, self.max_new = url, max_new
        self.first = threading.Event()
        self.status: int | None = None
        self.events: list[dict] = []
        self.done = False
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"input_ids": [1, 2, 3], "max_new_tokens": self.max_new, "ignore_eos": True,
                "stream": True}  # fmt: skip
        try:
            with requests.post(self.url + "/generate", json=body, stream=True,
                               timeout=300) as response:  # fmt: skip
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith(b"data: {"):
                        self.events.append(json.loads(line[6:]))
                        self.first.set()
                    self.done = self.done or line == b"data: [DONE]"
        except BaseException as e:
            self.error = e
        finally:
            self.first.set()

    def assert_finished(self) -> None:
        assert self.error is None and self.status == 200 and self.done, (self.status, self.error)
        assert self.events[-1]["finish_reason"] == "length"
        assert sum(len(e["token_ids"]) for e in self.events) == self.max_new


def metric(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return values[name]


def wait_in_flight_zero(url: str) -> None:
    deadline = time.monotonic() + 60
    while (n := metric(url, "toppings:num_requests_in_flight")) != 0:
        assert time.monotonic() < deadline, f"{n} requests still in flight"
        time.sleep(0.05)


def test_64_streams_share_one_running_batch_and_all_finish(default_server):
    url = default_server
    clients = [Streamer(url) for _ in range(NUM_CLIENTS)]
    for c in clients:
        c.start()
    max_running, stats_answers = 0, 0
    while any(c.is_alive() for c in clients):
        # /stats and /health answer while every stream is open, from the reserve threads.
        stats = requests.get(url + "/stats", timeout=30).json()
        assert requests.get(url + "/health", timeout=30).status_code == 200
        max_running = max(max_running, len(stats["running"]))
        stats_answers += 1
        time.sleep(0.05)
    for c in clients:
        c.join()
        c.assert_finished()
    assert max_running > OLD_THREAD_CAP, f"the running batch never exceeded {max_running}"
    assert stats_answers > 1
    wait_in_flight_zero(url)


def test_a_client_that_stops_reading_holds_up_no_one(default_server):
    url = default_server
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"input_ids": [4, 5, 6], "max_new_tokens": MAX_NEW, "ignore_eos": True,
                       "stream": True})  # fmt: skip
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: small window
    stalled.connect((host, int(port)))
    try:
        head = f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        stalled.sendall(head.encode() + body.encode())  # and never reads a byte of the answer
        deadline = time.monotonic() + 60
        while metric(url, "toppings:num_requests_in_flight") < 1:
            assert time.monotonic() < deadline, "the stalled client's request never started"
            time.sleep(0.02)
        others = [Streamer(url) for _ in range(8)]
        for c in others:
            c.start()
        for c in others:
            c.join()
            c.assert_finished()
        assert requests.get(url + "/health", timeout=30).status_code == 200
        # Its whole answer waits in buffers (waitress's, the kernel's): the request has ended
        # and given its slot back, though the client has still read nothing ...
        wait_in_flight_zero(url)
        # ... and none of it is lost when the client reads at last.
        assert sum(len(e["token_ids"]) for e in read_sse(stalled)) == MAX_NEW
    finally:
        stalled.close()


def read_sse(sock: socket.socket) -> list[dict]:
    """The events of a chunked SSE answer read from a raw socket, up to `data: [DONE]`."""
    sock.settimeout(30)
    data = b""
    while b"data: [DONE]" not in data:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed before the end of the stream"
        data += chunk
    lines = (line.strip() for line in data.split(b"\n"))
    return [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]


def test_the_ninth_request_past_a_limit_of_8_gets_429_and_the_eight_finish(limited_server):
    url = limited_server
    eight = [Streamer(url) for _ in range(8)]
    for c in eight:
        c.start()
    for c in eight:
        assert c.first.wait(120) and c.events, (c.status, c.error)  # all eight are in flight
    ninth = requests.post(url + "/generate", json={"prompt": "hi", "max_new_tokens": 2},
                          timeout=30)  # fmt: skip
    assert ninth.status_code == 429 and int(ninth.headers["Retry-After"]) >= 1
    assert ninth.json()["error"]["type"] == "too_many_requests"
    assert ninth.json()["error"]["code"] == 429
    assert requests.get(url + "/health", timeout=30).status_code == 200
    stats = requests.get(url + "/stats", timeout=30).json()
    assert (stats["num_in_flight"], stats["max_concurrent_requests"]) == (8, 8)
    for c in eight:
        c.join()
        c.assert_finished()
    wait_in_flight_zero(url)
    again = requests.post(url + "/generate", json={"prompt": "hi", "max_new_tokens": 2},
                          timeout=30)  # fmt: skip
    assert again.status_code == 200
    assert metric(url, "toppings:requests_rejected_total") == 1
