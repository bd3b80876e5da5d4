"""The child processes a command starts (toppings-demo's server and scheduler, the benches'
servers): started in a session of their own with their output in a log file, waited for until
healthy, stopped with a drain and then a kill."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

STOP_GRACE_S = 15.0  # how long a SIGTERM'd child may drain before SIGKILL


def wait_healthy(
    url: str, proc: subprocess.Popen, log: Path, timeout_s: float, up: tuple[int, ...] = (200,)
) -> None:
    """Poll `url/health` until its status is in `up`; exits with the log's tail if the process
    dies. A scheduler answers 503 until a server is registered: it is up then, not ready."""
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            sys.exit(f"toppings-demo: {proc.args[2]} exited with {proc.returncode}:\n{tail}")
        try:
            if requests.get(url + "/health", timeout=1.0).status_code in up:
                return
        except requests.RequestException:
            pass
        time.sleep(0.3)
    sys.exit(f"toppings-demo: {url} did not become healthy in {timeout_s:.0f} s (log: {log})")


def start(module: str, args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM (the server drains), then SIGKILL what is left after the grace period, or at
    once when interrupted again (a second Ctrl-C)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    try:
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    except KeyboardInterrupt:
        print("toppings-demo: killing both now", file=sys.stderr)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
