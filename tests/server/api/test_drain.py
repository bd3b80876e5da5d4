"""toppings-serve as a process: SIGTERM drains (in-flight requests finish, new ones get 503,
/health turns 503) and then it exits 0; the API key comes from TOPPINGS_API_KEY; --lora-dir
registers every adapter under it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import requests

from tests.helpers import wait_healthy

KEY = "drain-key"


def test_sigterm_drains_then_exits_zero(tmp_path, tiny_model_dir, free_port):
    from toppings.scripts.make_adapters import make_random_adapter

    make_random_adapter(tmp_path / "loras" / "d8", tiny_model_dir, rank=8, seed=5)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "toppings.server.cli", "--model", str(tiny_model_dir), "--port",
           str(port), "--lora-dir", str(tmp_path / "loras"), "--drain-timeout", "60",
           "--max-total-tokens", "1024"]  # fmt: skip
    env = dict(os.environ, TOPPINGS_API_KEY=KEY, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        wait_healthy(url, proc)
        assert requests.get(url + "/stats", timeout=10).status_code == 401
        models = requests.get(url + "/v1/models", headers=auth, timeout=10).json()
        assert "d8" in {m["id"] for m in models["data"]}
        max_new = 500  # most of the context: it is still running when the checks below run
        body = {"adapter": "d8", "input_ids": [1, 2, 3], "max_new_tokens": max_new,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with requests.post(url + "/generate", json=body, headers=auth, stream=True,
                           timeout=120) as long:  # fmt: skip
            lines = long.iter_lines()
            events = [json.loads(next(x for x in lines if x)[6:])]  # generating now
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while (health := requests.get(url + "/health", timeout=10)).status_code == 200:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert health.status_code == 503 and "draining" in health.text
            late = requests.post(url + "/generate", json={"prompt": "x"}, headers=auth, timeout=10)
            assert late.status_code == 503 and int(late.headers["Retry-After"]) >= 1
            events += [json.loads(x[6:]) for x in lines if x.startswith(b"data: {")]
        assert events[-1]["finish_reason"] == "length"
        assert sum(len(e["token_ids"]) for e in events) == max_new
        out = proc.communicate(timeout=90)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "draining" in out and "shutting down the engine" in out
