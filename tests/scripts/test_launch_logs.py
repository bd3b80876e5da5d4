"""toppings-launch's log directory: a temporary one is removed after a clean stop and kept when
something failed; a server that refuses its arguments is not restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time


def launch(tmp_path, model: str, port: int) -> subprocess.Popen:
    env = dict(os.environ, TMPDIR=str(tmp_path))  # where the launcher's temp log dir goes
    cmd = [sys.executable, "-m", "toppings.scripts.launch.cli", "--model", model, "--num-servers",
           "1", "--cpu-workers", "0", "--base-port", str(port)]  # fmt: skip
    return subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )


def log_dirs(tmp_path) -> list:
    return sorted(tmp_path.glob("toppings-launch-*"))


def test_clean_stop_removes_the_temporary_log_dir(tmp_path, tiny_model_dir, free_port):
    proc = launch(tmp_path, str(tiny_model_dir), free_port())
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while not any("servers healthy" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-20:])
            time.sleep(0.2)
        assert len(log_dirs(tmp_path)) == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, "".join(lines[-20:])
    assert log_dirs(tmp_path) == []


def test_a_refused_server_is_not_restarted_and_its_logs_stay(tmp_path, free_port):
    model = tmp_path / "not_a_llama"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "bert"}')  # passes the launcher's check
    proc = launch(tmp_path, str(model), free_port())
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0, stderr
    assert "Traceback" not in stderr, stderr
    assert "server 0 refused to start: toppings-serve: error: --model" in stderr, stderr
    assert "restarting" not in stderr and "restarts=1" not in stderr, stderr
    (kept,) = log_dirs(tmp_path)
    assert f"logs kept in {kept}" in stderr
    assert "error:" in (kept / "server-0.log").read_text()
