"""The real `toppings-scheduler` behind the same guarded waitress as a server: stalled
half-headers past its connection limit do not lock `/health` out, and SIGTERM stops it without
a traceback."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import requests

BOUND_S = 30  # every wait is bounded so that a broken build fails instead of hanging
HALF_HEADER = b"GET /health HTTP/1.1\r\nHost: x\r\n"


def answers(url: str) -> int | None:
    """The status of `url/health` (503 before any server registers: the scheduler is up)."""
    try:
        return requests.get(url + "/health", timeout=BOUND_S).status_code
    except requests.ConnectionError:
        return None


def test_scheduler_answers_health_past_stalled_half_headers(tmp_path, free_port):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "scheduler.log"
    cmd = [sys.executable, "-m", "toppings.scheduler.cli", "--port", str(port), "--registry",
           str(tmp_path / "registry.sqlite"), "--max-concurrent-requests", "1", "--threads", "1",
           "--header-timeout", "60"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while answers(url) is None:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        # 2 waitress threads make a limit of 4 connections; 8 sockets stall mid-header.
        stalled = []
        for _ in range(8):
            sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
            sock.sendall(HALF_HEADER)
            stalled.append(sock)
        try:
            assert answers(url) in (200, 503)
        finally:
            for sock in stalled:
                sock.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
