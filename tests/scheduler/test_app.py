"""Scheduler app: JSON errors and admin endpoints (Flask test client; no HTTP servers).

Servers are stood in for by `fetch_json`, the one function through which the cluster reads a
server's /v1/models and /stats. Proxying to real servers is tested end to end elsewhere.
"""

from __future__ import annotations

import pytest
import requests

from toppings.scheduler.app import create_app
from toppings.scheduler.cluster import Cluster
from toppings.scheduler.prompt_tokens import estimate_prompt_tokens
from toppings.scheduler.registry import Registry

URL = "http://10.0.0.1:8100"


def stats(healthy: bool = True, adapters=(("sql", 16), ("chat", 64))) -> dict:
    return {
        "model": "tiny-llama",
        "kernel": "mbgmv",
        "device": "cpu",
        "lora_mode": "cpu-assisted",
        "running": [
            {
                "id": "r1",
                "adapter": "sql",
                "rank": 16,
                "prompt_tokens": 10,
                "output_tokens": 3,
                "max_new_tokens": 20,
            }
        ],  # fmt: skip
        "queue": [],
        "adapters": [{"name": n, "rank": r, "resident": False} for n, r in adapters],
        "free_kv_tokens": 1000,
        "max_total_tokens": 2048,
        "healthy": healthy,
    }


class FakeServers:
    """url -> JSON answers; a URL missing from `answers` refuses the connection."""

    def __init__(self) -> None:
        self.answers: dict[str, dict] = {}

    def set(self, base: str, body: dict) -> None:
        self.answers[base + "/stats"] = body
        cards = [{"id": body["model"], "parent": None}]
        cards += [{"id": a["name"], "parent": body["model"], "rank": a["rank"]}
                  for a in body["adapters"]]  # fmt: skip
        self.answers[base + "/v1/models"] = {"object": "list", "data": cards}

    def __call__(self, url: str) -> dict:
        if url not in self.answers:
            raise requests.ConnectionError(f"connection refused: {url}")
        return self.answers[url]


@pytest.fixture
def setup(tmp_path, scheduler_parts):
    servers = FakeServers()
    with scheduler_parts(tmp_path, servers) as (registry, cluster, router):
        app = create_app(router, cluster, {"perf_model_source": "test"})
        yield app.test_client(), servers, cluster, registry


def assert_error(response, status: int, error_type: str | None = None) -> dict:
    assert response.status_code == status
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "code"} and error["code"] == status
    if error_type:
        assert error["type"] == error_type
    return error


def test_errors_are_json(setup):
    client, servers, *_ = setup
    servers.set(URL, stats())
    client.post("/admin/servers", json={"url": URL})
    assert_error(client.post("/v1/completions", data=b"{nope"), 400)
    assert_error(client.post("/v1/completions", json=[1, 2]), 400)
    assert_error(client.post("/v1/completions", json={"model": "x"}), 404, "not_found")
    assert_error(client.post("/generate", json={"adapter": "x"}), 404, "not_found")
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)
    assert_error(client.post("/admin/servers", json={"url": "ftp://x"}), 400)


def test_add_server_records_it_and_its_adapters(setup):
    client, servers, cluster, registry = setup
    servers.set(URL, stats())
    response = client.post("/admin/servers", json={"url": URL + "/"})
    assert response.status_code == 201
    assert response.get_json()["adapters"] == ["chat", "sql"]
    assert registry.hosting() == {URL: {"sql", "chat"}}
    assert registry.get_adapter("chat").rank == 64
    ids = {m["id"]: m["parent"] for m in client.get("/v1/models").get_json()["data"]}
    assert ids == {"tiny-llama": None, "sql": "tiny-llama", "chat": "tiny-llama"}
    state = client.get("/admin/state").get_json()
    assert state["policy"] == "rank-aware" and state["perf_model_source"] == "test"
    (server,) = state["servers"]
    assert (server["url"], server["healthy"], server["running"]) == (URL, True, 1)
    assert client.get("/health").get_json() == {"status": "ok", "num_servers": 1, "num_healthy": 1}
    registry.set_adapter_state("chat", "disabled")
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    error = assert_error(client.post("/v1/chat/completions", json=body), 404, "not_found")
    assert "disabled" in error["message"]
    assert "chat" not in {m["id"] for m in client.get("/v1/models").get_json()["data"]}


def test_unreachable_server_is_a_502_and_not_recorded(setup):
    client, _, _, registry = setup
    error = assert_error(client.post("/admin/servers", json={"url": URL}), 502, "bad_gateway")
    assert URL in error["message"]
    assert registry.list_servers() == []


def test_refresh_marks_failures_unhealthy_and_requests_then_get_503(setup):
    client, servers, cluster, registry = setup
    servers.set(URL, stats())
    client.post("/admin/servers", json={"url": URL})
    del servers.answers[URL + "/stats"]
    cluster.refresh_once()
    assert registry.list_servers()[0].healthy is False
    assert cluster.states()[0].healthy is False
    body = {"model": "sql", "prompt": "hello", "max_tokens": 8}
    assert_error(client.post("/v1/completions", json=body), 503, "no_server_available")
    # It comes back, with a changed adapter set, which the registry follows.
    servers.set(URL, stats(adapters=(("sql", 16),)))
    cluster.refresh_once()
    assert cluster.states()[0].healthy is True
    assert registry.hosting() == {URL: {"sql"}}


def test_delete_server_and_restart_keeps_it(setup, tmp_path):
    client, servers, cluster, registry = setup
    servers.set(URL, stats())
    client.post("/admin/servers", json={"url": URL})
    client.post("/admin/servers", json={"url": "http://b:1"})  # refused: not recorded
    # A scheduler restarted on the same registry knows the server before any request.
    again = Cluster(Registry(tmp_path / "reg.sqlite"), servers)
    assert again.urls() == [URL]
    again.refresh_once()
    assert [s.url for s in again.states()] == [URL]
    again.stop()
    assert_error(client.delete("/admin/servers", json={"url": "http://b:1"}), 404, "not_found")
    assert client.delete(f"/admin/servers?url={URL}").status_code == 200
    assert registry.list_servers() == [] and cluster.urls() == []


def test_add_adapter_validates_and_records(setup):
    client, *_, registry = setup
    body = {
        "name": "law",
        "base_model": "tiny-llama",
        "rank": 32,
        "alpha": 64,
        "target_modules": ["q_proj", "v_proj"],
        "path": "/adapters/law",
        "bytes": 4096,
    }
    response = client.post("/admin/adapters", json=body)
    assert response.status_code == 201
    assert response.get_json() == {"adapter": "law", "loaded_on": [], "failed": {}}
    law = registry.get_adapter("law")
    assert (law.rank, law.alpha, law.target_modules, law.num_bytes) == (
        32, 64.0, ("q_proj", "v_proj"), 4096
    )  # fmt: skip
    assert_error(client.post("/admin/adapters", json={**body, "rank": 0}), 400)
    assert_error(client.post("/admin/adapters", json={**body, "rank": True}), 400)
    assert_error(client.post("/admin/adapters", json={**body, "target_modules": "q_proj"}), 400)
    assert_error(client.post("/admin/adapters", json={"name": "x", "rank": 8}), 400)
    no_path = {"name": "y", "base_model": "tiny-llama", "rank": 8, "servers": [URL]}
    assert_error(client.post("/admin/adapters", json=no_path), 400)
    other_base = {**body, "base_model": "mistral"}
    assert_error(client.post("/admin/adapters", json=other_base), 409, "conflict")
    assert_error(client.post("/admin/adapters", json={**body, "rank": 8}), 409, "conflict")
    for name in ("../../etc", "x" * 129, "", "-a", 5):
        assert_error(client.post("/admin/adapters", json={**body, "name": name}), 400)
    assert registry.get_adapter("law").rank == 32


def test_what_no_server_serves_is_not_listed_and_a_404(setup):
    """An adapter recorded for a base no server runs, or that its last server stopped hosting,
    is neither in /v1/models nor a 503 that never clears: a 404; DELETE forgets a record."""
    client, servers, cluster, registry = setup
    servers.set(URL, stats())
    assert client.post("/admin/servers", json={"url": URL}).status_code == 201
    law = {"name": "law", "base_model": "tiny-llama", "rank": 8}
    ghost = {"name": "ghost", "base_model": "no-such-base", "rank": 8}
    for body in (law, ghost):
        assert client.post("/admin/adapters", json=body).status_code == 201
    servers.set(URL, stats(adapters=(("sql", 16),)))  # "chat" unloaded there
    cluster.refresh_once()
    listed = {m["id"] for m in client.get("/v1/models").get_json()["data"]}
    assert listed == {"tiny-llama", "sql"}
    for model in ("law", "ghost", "chat"):
        body = {"model": model, "prompt": "hello", "max_tokens": 8}
        error = assert_error(client.post("/v1/completions", json=body), 404, "not_found")
        assert f"'{model}' does not exist" in error["message"]
        assert_error(client.get(f"/v1/models/{model}"), 404, "not_found")
    # a record made only from the server's report goes with its last host; an operator's stays
    assert registry.get_adapter("chat") is None and registry.get_adapter("law") is not None
    answer = client.delete("/admin/adapters", json={"name": "law"})
    assert answer.status_code == 200 and answer.get_json()["removed"] == "law"
    assert registry.get_adapter("law") is None
    assert_error(client.delete("/admin/adapters", json={"name": "law"}), 404, "not_found")


def test_a_server_url_has_one_spelling_and_no_credentials(setup):
    client, servers, _, registry = setup
    servers.set(URL, stats())
    assert client.post("/admin/servers", json={"url": "HTTP://10.0.0.1:8100/"}).status_code == 201
    assert [s.url for s in registry.list_servers()] == [URL]
    error = assert_error(client.post("/admin/servers", json={"url": "http://u:p@10.0.0.1:8100"}),
                         400)  # fmt: skip
    assert "credentials" in error["message"] and "u:p" not in error["message"]


def test_prompt_token_estimate():
    assert estimate_prompt_tokens({"prompt": [1, 2, 3]}) == 3
    assert estimate_prompt_tokens({"prompt": [[1, 2, 3], [4]], "n": 2}) == 8
    assert estimate_prompt_tokens({"prompt": ["x" * 40, "y" * 8]}) == 12
    assert estimate_prompt_tokens({"prompt": "x" * 40}) == 10
    assert estimate_prompt_tokens({"messages": [{"role": "user", "content": "x" * 24}]}) == 10
