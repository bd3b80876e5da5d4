"""The scheduler's drain: new requests get 503, those in flight (streams too) run to their end.

In process, the drain is the `Drainer` object around the app's in-flight limit with a `stop`
that records its call (the servers are stand-ins, as in test_app_operator). Once end to end:
the real `toppings-scheduler` in a subprocess, in front of a stand-in server whose stream waits
for the test, gets SIGTERM mid-stream.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests
from flask import Flask, Response, jsonify
from werkzeug.serving import make_server

from tests.helpers import wait_healthy
from tests.scheduler.test_app import URL, FakeServers, stats
from tests.scheduler.test_app_operator import SSE, Answer, Session
from toppings.scheduler.app import create_app
from toppings.scheduler.drain import in_flight_ended
from toppings.server.http.drain import Drainer

BODY = {"model": "sql", "prompt": "hello", "max_tokens": 4}
STREAM = dict(BODY, stream=True)


@pytest.fixture
def setup(tmp_path, scheduler_parts):
    """(app, stand-in session, drain flag) of a scheduler with one registered stand-in."""
    servers = FakeServers()
    servers.set(URL, stats())
    with scheduler_parts(tmp_path, servers, Session()) as (_, cluster, router):
        draining = threading.Event()
        app = create_app(router, cluster, {"perf_model_source": "test"}, draining=draining)
        assert app.test_client().post("/admin/servers", json={"url": URL}).status_code == 201
        yield app, router.session, draining


def test_a_stream_in_flight_completes_and_new_requests_get_503(setup):
    app, session, draining = setup
    client, in_flight = app.test_client(), app.extensions["toppings"]
    session.script = [Answer(200, [SSE[:10], SSE[10:20], SSE[20:]])]
    held = client.post("/v1/completions", json=STREAM, buffered=False)
    chunks = iter(held.response)
    first = next(chunks)
    stopped = threading.Event()
    drainer = Drainer(draining, in_flight_ended(in_flight), timeout_s=600.0, stop=stopped.set)
    thread = drainer.begin()

    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/tokenize"):
        refused = client.post(path, json=BODY)
        assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
        error = refused.get_json()["error"]
        assert (error["code"], error["type"]) == (503, "unavailable")
        assert "draining" in error["message"]
    health = client.get("/health")
    assert health.status_code == 503 and "draining" in health.get_json()["error"]["message"]
    assert client.get("/stats").get_json()["draining"] is True
    assert session.script == []  # nothing new reached a server
    assert not stopped.is_set() and thread.is_alive()  # the stream is still in flight

    rest = b"".join(chunks)
    held.close()
    assert first + rest == SSE  # the whole stream, [DONE] included
    thread.join(timeout=60)
    assert stopped.is_set() and not thread.is_alive() and in_flight.num_in_flight == 0


def test_a_drain_past_its_deadline_stops_anyway(setup, caplog):
    app, session, draining = setup
    client, in_flight = app.test_client(), app.extensions["toppings"]
    session.script = [Answer(200, [SSE[:10], SSE[10:]])]
    held = client.post("/v1/completions", json=STREAM, buffered=False)
    next(iter(held.response))
    calls = []
    drainer = Drainer(draining, in_flight_ended(in_flight), 0.0, stop=lambda: calls.append("stop"))
    with caplog.at_level(logging.WARNING, logger="toppings-scheduler"):
        assert drainer.run() is False
    assert calls == ["stop"] and "drain timed out" in caplog.text
    held.close()


def test_an_idle_drain_stops_at_once(setup):
    app, _, draining = setup
    calls = []
    wait = in_flight_ended(app.extensions["toppings"])
    drainer = Drainer(draining, wait, 600.0, lambda: calls.append(1), lambda: calls.append(0))
    assert drainer.run() is True and calls == [1]  # nothing left: nothing aborted


def test_a_drain_out_of_time_aborts_what_is_left_before_it_stops():
    """toppings-serve passes Engine.abort_all: each client gets its end (finish_reason
    "abort"), not a connection cut when waitress stops."""
    calls = []
    drainer = Drainer(threading.Event(), lambda timeout_s: False, 0.0,
                      lambda: calls.append("stop"), lambda: calls.append("abort"))  # fmt: skip
    assert drainer.run() is False and calls == ["abort", "stop"]


def _slow_stream_server(release: threading.Event) -> Flask:
    """A stand-in server whose streamed completion sends one event, then waits for `release`."""
    app = Flask("slow-stream")

    @app.get("/v1/models")
    def models():
        return jsonify(object="list", data=[{"id": "base", "parent": None}])

    @app.get("/stats")
    def stats_():
        return jsonify(
            model="base", kernel="mbgmv", device="cpu", lora_mode="cached", running=[],
            queue=[], adapters=[], free_kv_tokens=1000, max_total_tokens=1000, healthy=True,
        )  # fmt: skip

    @app.post("/v1/completions")
    def completions():
        def events():
            yield b"data: " + json.dumps({"choices": [{"text": "a"}]}).encode() + b"\n\n"
            release.wait(60)
            yield b"data: " + json.dumps({"choices": [{"text": "b"}]}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return Response(events(), content_type="text/event-stream")

    return app


@contextlib.contextmanager
def _scheduler_before_slow_stream(tmp_path, port: int, *flags: str, env: dict | None = None):
    """A running `toppings-scheduler` on `port` (its `flags`, `env` over this environment
    without TOPPINGS_ variables) and a stand-in server whose streams wait for `release`:
    yields (scheduler url, its process, the stand-in's url, release); stops both."""
    release = threading.Event()
    http = make_server("127.0.0.1", 0, _slow_stream_server(release), threaded=True)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TOPPINGS_")}
    cmd = [sys.executable, "-m", "toppings.scheduler.cli", "--registry", str(tmp_path / "r.db"),
           "--port", str(port), "--refresh-ms", "50", *flags]  # fmt: skip
    proc = subprocess.Popen(cmd, env={**environ, **(env or {})}, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(url, proc, timeout_s=60, statuses=(200, 503))
        yield url, proc, f"http://127.0.0.1:{http.server_port}", release
    finally:
        release.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        http.shutdown()


def test_sigterm_drains_the_running_scheduler_and_exits_0(tmp_path, free_port):
    """Also the command's keys: the client key from the environment, the admin key from its
    flag, and the warning of a non-loopback listener (0.0.0.0) without an admin key is absent."""
    flags = ("--host", "0.0.0.0", "--admin-api-key", "admin-key")
    env = {"TOPPINGS_SCHEDULER_API_KEY": "client-key"}
    client = {"Authorization": "Bearer client-key"}
    with _scheduler_before_slow_stream(tmp_path, free_port(), *flags, env=env) as running:
        url, proc, server_url, release = running
        refused = requests.post(url + "/admin/servers", json={"url": server_url}, headers=client,
                                timeout=10)  # fmt: skip
        assert refused.status_code == 401
        added = requests.post(url + "/admin/servers", json={"url": server_url}, timeout=10,
                              headers={"Authorization": "Bearer admin-key"})  # fmt: skip
        assert added.status_code == 201, added.text
        body = {"model": "base", "prompt": "hi", "max_tokens": 4, "stream": True}
        assert requests.post(url + "/v1/completions", json=body, timeout=10).status_code == 401
        stream = requests.post(url + "/v1/completions", json=body, stream=True, timeout=60,
                               headers=client)  # fmt: skip
        lines = stream.iter_lines()
        assert next(line for line in lines if line).startswith(b"data: ")  # first event in
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while requests.get(url + "/health", timeout=5).status_code != 503:  # draining now
            assert time.monotonic() < deadline, "the scheduler did not start draining"
            time.sleep(0.1)
        refused = requests.post(url + "/v1/completions", json=dict(body, stream=False),
                                headers=client, timeout=10)  # fmt: skip
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        assert proc.poll() is None  # still serving the stream
        release.set()
        rest = [line for line in lines if line]
        assert rest[-1] == b"data: [DONE]" and len(rest) == 2
        assert proc.wait(timeout=60) == 0
        log = proc.stderr.read()
        assert "SIGTERM: draining" in log and "stopped" in log
        assert "without --admin-api-key" not in log


def test_sighup_drains_too(tmp_path, free_port):
    """The terminal that started it closed: a drain, not an instant death."""
    port = free_port()
    cmd = [sys.executable, "-m", "toppings.scheduler.cli", "--registry", str(tmp_path / "r.db"),
           "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout_s=60, statuses=(200, 503))
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=60) == 0
        assert "SIGHUP: draining" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stream_still_running_when_the_drain_times_out_gets_an_end(tmp_path, free_port):
    """The drain's time ran out with a stream in flight: its client reads an error event (503,
    the drain) and [DONE] (it was a cut connection, seconds later)."""
    with _scheduler_before_slow_stream(tmp_path, free_port(), "--drain-timeout", "1") as running:
        url, proc, server_url, _ = running
        assert requests.post(url + "/admin/servers", json={"url": server_url},
                             timeout=10).status_code == 201  # fmt: skip
        body = {"model": "base", "prompt": "hi", "max_tokens": 4, "stream": True}
        stream = requests.post(url + "/v1/completions", json=body, stream=True, timeout=60)
        lines = stream.iter_lines()
        assert next(line for line in lines if line).startswith(b"data: ")  # first event in
        proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]  # the stand-in never sends more
        assert rest[-1] == b"data: [DONE]" and len(rest) == 2, rest
        error = json.loads(rest[0][6:])["error"]
        assert (error["code"], error["type"]) == (503, "unavailable")
        assert "--drain-timeout" in error["message"]
        assert proc.wait(timeout=60) == 0
