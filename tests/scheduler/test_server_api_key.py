"""toppings-scheduler --server-api-key: /stats polling and proxied requests carry the bearer key.

A stand-in server (werkzeug, in a thread) answers /v1/models, /stats and /v1/completions only to
`Authorization: Bearer KEY`, 401 otherwise, and records what it was sent; the scheduler is the
real command in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import requests
from flask import Flask, jsonify, request
from werkzeug.serving import make_server

from tests.helpers import wait_healthy

KEY = "s3cret-key"


def _stand_in_server(seen: list[tuple[str, str | None]]) -> Flask:
    app = Flask("stand-in")

    @app.before_request
    def check_key():
        seen.append((request.path, request.headers.get("Authorization")))
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return jsonify(error={"message": "bad key", "type": "auth", "code": 401}), 401

    @app.get("/v1/models")
    def models():
        cards = [{"id": "base", "parent": None}, {"id": "a8", "parent": "base", "rank": 8}]
        return jsonify(object="list", data=cards)

    @app.get("/stats")
    def stats():
        return jsonify(
            model="base", kernel="mbgmv", device="cpu", lora_mode="cached", running=[],
            queue=[], adapters=[{"name": "a8", "rank": 8, "resident": True}],
            free_kv_tokens=1000, max_total_tokens=1000, healthy=True,
        )  # fmt: skip

    @app.post("/v1/completions")
    def completions():
        return jsonify(object="text_completion", model="a8", choices=[{"text": "ok"}])

    return app


@pytest.fixture
def stand_in():
    seen: list[tuple[str, str | None]] = []
    server = make_server("127.0.0.1", 0, _stand_in_server(seen), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", seen
    server.shutdown()


@pytest.mark.parametrize("key_from", ["flag", "environment", None])
def test_scheduler_sends_the_server_key(stand_in, tmp_path, key_from, free_port):
    """environment: the servers' own two variables, as toppings-launch passes one environment to
    servers and scheduler alike: the admin key (which opens every route) wins over the client
    key."""
    server_url, seen = stand_in
    port = free_port()
    cmd = [sys.executable, "-m", "toppings.scheduler.cli", "--registry", str(tmp_path / "r.sqlite"),
           "--port", str(port)]  # fmt: skip
    names = ("TOPPINGS_API_KEY", "TOPPINGS_SERVER_ADMIN_API_KEY")  # the flag's defaults
    env = {k: v for k, v in os.environ.items() if k not in names}
    if key_from == "flag":
        cmd += ["--server-api-key", KEY]
    elif key_from == "environment":
        env.update(TOPPINGS_API_KEY="the-client-key", TOPPINGS_SERVER_ADMIN_API_KEY=KEY)
    with_key = key_from is not None
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        # 503 "no server ready yet" until a server is registered: it is up.
        wait_healthy(url, proc, timeout_s=60, statuses=(200, 503))
        added = requests.post(url + "/admin/servers", json={"url": server_url}, timeout=10)
        if not with_key:  # the server refuses the scheduler: it cannot be registered
            assert added.status_code >= 400 and "error" in added.json()
            assert seen and all(auth is None for _, auth in seen)
            return
        assert added.status_code == 201, added.text
        body = {"model": "a8", "prompt": "hi", "max_tokens": 4}
        answer = requests.post(url + "/v1/completions", json=body, timeout=10)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "ok"
        time.sleep(0.3)  # a few /stats polls
        paths = {path for path, _ in seen}
        assert {"/v1/models", "/stats", "/v1/completions"} <= paths
        assert all(auth == f"Bearer {KEY}" for _, auth in seen)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
