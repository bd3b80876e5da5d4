"""The waitress front end (GuardedServer, in a thread, and in the real `toppings-serve`): more
stalled half-headers than the connection limit do not lock /health out, a header trickled line
by line is closed at the header deadline, a body that does not come is answered 408 while one
sent steadily is served, a request already running is never closed by any of these;
a stop lets the running responses end and leaves the trigger open for their handlers."""

from __future__ import annotations

import json
import logging
import select
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from tests.helpers import wait_healthy
from toppings.server.http.frontend import waitress_settings
from toppings.server.http.waitress_server import GuardedServer

BOUND_S = 30  # every wait is bounded so that a broken build fails instead of hanging
HALF_HEADER = b"GET /health HTTP/1.1\r\nHost: x\r\n"


@pytest.fixture
def serve():
    """Start a GuardedServer with a small connection limit; returns its base URL, its port, and
    the events set when /slow runs and that let /slow answer."""
    servers, running, release = [], threading.Event(), threading.Event()

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/slow":
            running.set()
            release.wait(BOUND_S)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    def start(header_timeout_s: int) -> tuple[str, int, threading.Event, threading.Event]:
        # 1 request in flight + 1 reserve: 2 threads, 4 connections (2 of them waitress's own
        # listener and trigger).
        settings = waitress_settings(1, 1, header_timeout_s)
        server = GuardedServer(app, header_timeout_s, host="127.0.0.1", port=0, **settings)
        threading.Thread(target=server.run, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.effective_port}", server.effective_port, running, release

    yield start
    release.set()
    for server in servers:
        server.task_dispatcher.shutdown()
        server.trigger.pull_trigger(server.close)


def half_headers(port: int, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
        sock.sendall(HALF_HEADER)
        socks.append(sock)
    return socks


def closed_by_server(sock: socket.socket) -> bool:
    """The server closed its end (EOF or reset), seen without blocking."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_stalled_half_headers_past_the_limit_do_not_lock_out_health(serve):
    """The header deadline (60 s) is past the bound: only making room at the limit helps."""
    url, port, _, _ = serve(60)
    stalled = half_headers(port, 8)  # twice the connection limit, all stalled
    try:
        health = requests.get(url + "/health", timeout=BOUND_S)
        assert health.status_code == 200 and health.text == "ok"
    finally:
        for sock in stalled:
            sock.close()


def test_a_trickled_header_is_closed_at_the_header_deadline(serve):
    """Bytes keep coming (waitress's idle timeout never fires), the headers never end."""
    url, port, _, _ = serve(2)
    (sock,) = half_headers(port, 1)
    deadline = time.monotonic() + BOUND_S
    try:
        while not closed_by_server(sock):
            assert time.monotonic() < deadline, "the trickled header was never closed"
            try:
                sock.sendall(b"X-Trickle: 1\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
            select.select([sock], [], [], 0.2)
    finally:
        sock.close()
    assert requests.get(url + "/health", timeout=BOUND_S).status_code == 200


def read_answer(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection."""
    sock.settimeout(BOUND_S)
    got = b""
    while chunk := sock.recv(4096):
        got += chunk
    return got


def test_a_body_that_does_not_come_is_answered_408(serve):
    """A Content-Length larger than the body sent (nothing more comes), and a body trickled a
    byte at a time (waitress's idle timeout never fires): a 408 with the JSON error, then the
    connection is closed; the server goes on answering."""
    url, port, _, _ = serve(1)
    head = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    short = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    short.sendall(head + b"Content-Length: 100\r\n\r\n" + b"{}" * 5)
    trickled = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    trickled.sendall(head + b"Content-Length: 100000\r\n\r\n")
    deadline = time.monotonic() + BOUND_S
    try:
        while not select.select([trickled], [], [], 0.2)[0]:
            assert time.monotonic() < deadline, "the trickled body was never answered"
            trickled.sendall(b" ")
        for sock in (short, trickled):
            answer = read_answer(sock)
            assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer[:200]
            error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
            assert error["code"] == 408 and error["type"] == "request_timeout"
            assert "body did not arrive in time" in error["message"]
    finally:
        short.close()
        trickled.close()
    assert requests.get(url + "/health", timeout=BOUND_S).status_code == 200


def test_a_body_sent_steadily_outlives_the_first_seconds(serve):
    """A second later for every 500 bytes: 8,000 bytes at about 4,000 a second, past a
    1-second deadline for the body's first bytes, are served."""
    url, port, _, _ = serve(1)
    sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    try:
        sock.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 8000\r\n\r\n")
        for _ in range(20):
            time.sleep(0.1)
            sock.sendall(b"x" * 400)
        sock.shutdown(socket.SHUT_WR)
        assert read_answer(sock).startswith(b"HTTP/1.1 200 OK")
    finally:
        sock.close()


def test_a_body_read_ahead_waits_for_the_running_request_not_the_client(serve):
    """Request 2's headers and first bytes arrive with request 1, which runs past the deadline:
    request 2's clock starts when request 1 ends (a 408 came a second after it)."""
    url, port, running, release = serve(3)
    sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    try:
        sock.sendall(
            b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
            b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * 20
        )
        assert running.wait(BOUND_S)
        time.sleep(5)  # past request 2's deadline, had its clock run meanwhile
        release.set()
        got = b""
        while got.count(b"HTTP/1.1 ") < 1 or not got.endswith(b"ok"):
            got += sock.recv(4096)
        assert got.startswith(b"HTTP/1.1 200")
        time.sleep(1.0)  # the client sends the rest a second after its first answer
        sock.sendall(b"x" * 80)
        rest = read_answer_until(sock, b"ok")
        assert rest.startswith(b"HTTP/1.1 200"), rest[:200]
    finally:
        sock.close()


def read_answer_until(sock: socket.socket, end: bytes) -> bytes:
    sock.settimeout(BOUND_S)
    got = b""
    while not got.endswith(end):
        chunk = sock.recv(4096)
        if not chunk:
            break
        got += chunk
    return got


def test_a_running_request_outlives_the_header_deadline(serve):
    url, port, running, release = serve(1)
    result: list = []
    slow = threading.Thread(
        target=lambda: result.append(requests.get(url + "/slow", timeout=BOUND_S)), daemon=True
    )
    slow.start()
    assert running.wait(BOUND_S)
    (stalled,) = half_headers(port, 1)  # opened after the slow request: its deadline is later
    deadline = time.monotonic() + BOUND_S
    try:
        while not closed_by_server(stalled):  # the deadline has passed for the slow one too
            assert time.monotonic() < deadline, "the stalled header was never closed"
            select.select([stalled], [], [], 0.2)
    finally:
        stalled.close()
    release.set()
    slow.join(BOUND_S)
    assert result and result[0].status_code == 200 and result[0].text == "ok"


def test_stop_lets_a_response_end_then_closes_without_a_traceback(caplog):
    """A stream still being written when the stop comes gets its last bytes; the loop returns;
    a handler thread may still pull the trigger until `release` (no "Bad file descriptor")."""
    first_sent, finish = threading.Event(), threading.Event()

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])

        def body():
            yield b"first;"
            first_sent.set()
            assert finish.wait(BOUND_S)
            yield b"last"

        return body()

    settings = waitress_settings(1, 1)
    server = GuardedServer(app, 10, host="127.0.0.1", port=0, **settings)
    loop = threading.Thread(target=server.run, daemon=True)
    loop.start()
    url = f"http://127.0.0.1:{server.effective_port}/stream"
    with requests.get(url, stream=True, timeout=BOUND_S) as response:
        chunks = response.iter_content(chunk_size=None)
        assert first_sent.wait(BOUND_S)
        stopper = threading.Thread(target=server.stop, args=(BOUND_S,), daemon=True)
        stopper.start()
        loop.join(1)  # the connection of a handler still running must stay open meanwhile
        finish.set()
        received = b"".join(chunks)
    stopper.join(BOUND_S)
    loop.join(BOUND_S)
    assert not loop.is_alive()  # run() returned: every socket is closed
    assert received == b"first;last"
    server.pull_trigger()  # a handler ending now: the pipe is still open
    server.release()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_toppings_serve_answers_health_past_stalled_half_headers(
    tmp_path, tiny_model_dir, free_port
):
    """The real command: 2 waitress threads, 4 connections, a header timeout past the bound."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "toppings.server.cli", "--model", str(tiny_model_dir), "--port",
           str(port), "--max-concurrent-requests", "1", "--threads", "1", "--header-timeout",
           "60", "--max-total-tokens", "1024"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, log)
        stalled = half_headers(port, 8)
        try:
            assert requests.get(url + "/health", timeout=BOUND_S).status_code == 200
            ok = requests.post(url + "/generate", json={"prompt": "hi", "max_new_tokens": 2},
                               timeout=BOUND_S)  # fmt: skip
            assert ok.status_code == 200
        finally:
            for sock in stalled:
                sock.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert proc.returncode == 0
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
