"""The servers' key goes to the servers an operator registered, and nowhere else.

Stand-in servers (werkzeug, each in a thread) record every request and the Authorization it
carried; the scheduler is its Flask app on the test client, wired as `toppings-scheduler` wires
it (one `ServerOrigins` shared by the cluster and the sessions, the key on the sessions).
"""

from __future__ import annotations

import threading

import pytest
from flask import Flask, jsonify, redirect, request
from werkzeug.serving import make_server

from toppings.scheduler.adapter_sync import AdapterSync
from toppings.scheduler.app import create_app
from toppings.scheduler.auth import AccessKeys
from toppings.scheduler.cli import make_fetch_json
from toppings.scheduler.cluster import Cluster
from toppings.scheduler.paper_models import paper_fig6_models
from toppings.scheduler.policies import make_policy
from toppings.scheduler.registry import AdapterRecord, Registry
from toppings.scheduler.router import Router
from toppings.scheduler.server_session import (
    RedirectRefused,
    ServerOrigins,
    ServerSession,
    origin,
)

SERVER_KEY = "server-key"
ADMIN = {"Authorization": "Bearer admin-key"}
BODY = {"model": "a8", "prompt": "hi", "max_tokens": 4}


class StandIn:
    """A server that answers like toppings-serve and records (method, path, Authorization);
    with `redirect_to` set, it answers every request with a 307 there instead."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None]] = []
        self.redirect_to: str | None = None
        app = Flask("stand-in")
        app.before_request(self._record)
        app.get("/v1/models")(self._models)
        app.get("/stats")(self._stats)
        app.post("/v1/completions")(self._completions)
        app.post("/v1/load_lora_adapter")(self._load)
        self.http = make_server("127.0.0.1", 0, app, threaded=True)
        self.url = f"http://127.0.0.1:{self.http.server_port}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def _record(self):
        self.seen.append((request.method, request.path, request.headers.get("Authorization")))
        if self.redirect_to is not None:
            return redirect(self.redirect_to + request.path, 307)
        return None

    def _models(self):
        cards = [{"id": "base", "parent": None}, {"id": "a8", "parent": "base", "rank": 8}]
        return jsonify(object="list", data=cards)

    def _stats(self):
        return jsonify(
            model="base", kernel="mbgmv", device="cpu", lora_mode="cached", running=[],
            queue=[], adapters=[{"name": "a8", "rank": 8, "resident": True}],
            free_kv_tokens=1000, max_total_tokens=1000, healthy=True,
        )  # fmt: skip

    def _completions(self):
        return jsonify(object="text_completion", model="a8", choices=[{"text": "ok"}])

    def _load(self):
        return jsonify(lora_name=request.get_json()["lora_name"])

    def keys_seen(self) -> set[str | None]:
        return {auth for _, _, auth in self.seen}

    def close(self) -> None:
        self.http.shutdown()


@pytest.fixture
def stand_ins():
    servers = [StandIn() for _ in range(3)]
    yield servers
    for server in servers:
        server.close()


@pytest.fixture
def scheduler(tmp_path):
    """(test client, cluster, registry, the polling session) of a scheduler with the key."""
    registry = Registry(tmp_path / "reg.sqlite")
    origins = ServerOrigins()
    polling = ServerSession(origins, SERVER_KEY)
    cluster = Cluster(registry, make_fetch_json(polling), origins=origins)
    policy = make_policy("rank-aware", paper_fig6_models(), 50.0)
    router = Router(registry, cluster, policy, session=ServerSession(origins, SERVER_KEY))
    keys = AccessKeys(admin_api_key="admin-key")
    app = create_app(router, cluster, {"perf_model_source": "test"}, keys=keys)
    yield app.test_client(), cluster, registry, polling
    cluster.stop()
    registry.close()


def test_the_key_goes_to_the_registered_server_and_nowhere_else(scheduler, stand_ins):
    client, cluster, registry, polling = scheduler
    server, other, _ = stand_ins
    assert "Authorization" not in polling.session.headers  # never a default header
    added = client.post("/admin/servers", json={"url": server.url}, headers=ADMIN)
    assert added.status_code == 201, added.get_json()
    assert {path for _, path, _ in server.seen} == {"/v1/models", "/stats"}
    assert server.keys_seen() == {f"Bearer {SERVER_KEY}"}

    # An adapter to load on a URL nobody registered: refused whole, nothing sent or recorded.
    body = {"name": "new", "base_model": "base", "rank": 8, "path": "/adapters/new",
            "servers": [server.url, other.url + "/"]}  # fmt: skip
    before = len(server.seen)
    refused = client.post("/admin/adapters", json=body, headers=ADMIN)
    assert refused.status_code == 400
    message = refused.get_json()["error"]["message"]
    assert other.url in message and server.url not in message
    assert other.seen == [] and len(server.seen) == before
    assert registry.get_adapter("new") is None

    loaded = client.post("/admin/adapters", json=dict(body, servers=[server.url]), headers=ADMIN)
    assert loaded.status_code == 201 and loaded.get_json()["loaded_on"] == [server.url]
    answer = client.post("/v1/completions", json=BODY)
    assert answer.status_code == 200 and answer.headers["X-Toppings-Server"] == server.url
    assert ("POST", "/v1/load_lora_adapter", f"Bearer {SERVER_KEY}") in server.seen
    assert ("POST", "/v1/completions", f"Bearer {SERVER_KEY}") in server.seen

    # The same session, asked for a URL of another origin, sends no key.
    assert polling.get(other.url + "/stats", timeout=5).status_code == 200
    assert other.keys_seen() == {None}

    # Removed, the server gets no key any more.
    assert (
        client.delete("/admin/servers", json={"url": server.url}, headers=ADMIN).status_code < 300
    )
    polling.get(server.url + "/stats", timeout=5)
    assert server.seen[-1] == ("GET", "/stats", None)


def test_a_server_that_cannot_be_registered_gets_no_key_afterwards(scheduler, stand_ins):
    client, _, _, polling = scheduler
    server, elsewhere, _ = stand_ins
    server.redirect_to = elsewhere.url  # its /v1/models answers 307
    refused = client.post("/admin/servers", json={"url": server.url}, headers=ADMIN)
    assert refused.status_code == 502 and "redirect" in refused.get_json()["error"]["message"]
    assert elsewhere.seen == []  # the redirect was not followed
    server.redirect_to = None
    polling.get(server.url + "/stats", timeout=5)
    assert server.seen[-1] == ("GET", "/stats", None)


def test_a_redirect_from_a_server_is_a_failed_call(scheduler, stand_ins):
    client, cluster, registry, polling = scheduler
    server, attacker, holder = stand_ins
    assert client.post("/admin/servers", json={"url": server.url}, headers=ADMIN).status_code < 300
    server.redirect_to = attacker.url
    answer = client.post("/v1/completions", json=BODY)
    assert answer.status_code == 502 and answer.get_json()["error"]["type"] == "bad_gateway"
    with pytest.raises(RedirectRefused):
        polling.get(server.url + "/stats", timeout=5)
    # LoRAServe's adapter sync asks the server to fetch an adapter: redirected, it failed.
    registry.put_adapter(AdapterRecord("a8", "base", 8, sha256="0" * 64))
    hosting = {server.url: frozenset(), holder.url: frozenset({"a8"})}
    sync = AdapterSync(registry, lambda: hosting, polling)
    try:
        outcome = sync.sync({"a8": {server.url: 0.5, holder.url: 0.5}})
    finally:
        sync.close()
    assert (outcome["fetched"], outcome["fetch_failed"]) == (0, 1)
    assert attacker.seen == [] and holder.seen == []  # neither the body nor the key went on
    assert not any(s["healthy"] for s in cluster.describe())


def test_origins_compare_scheme_host_and_port():
    assert origin("http://Host:80/x") == origin("http://host") == ("http", "host", 80)
    assert origin("https://h/") == ("https", "h", 443)
    assert origin("ftp://h") is None and origin("http://h:notaport") is None
    origins = ServerOrigins()
    origins.add("http://10.0.0.1:8100")
    assert origins.trusts("http://10.0.0.1:8100/v1/completions")
    assert not origins.trusts("http://10.0.0.1:8101/stats")
    assert not origins.trusts("https://10.0.0.1:8100/stats")
    assert not origins.trusts("http://10.0.0.1.evil.example:8100/stats")
    origins.discard("http://10.0.0.1:8100")
    assert not origins.trusts("http://10.0.0.1:8100/stats")
