"""The scheduler's own in-flight limit (429 with Retry-After past it, the slot back on every path)
and a server's 429 (busy: the next server is tried; all busy: 429 to the client).

Servers are stand-ins, as in test_app_operator: `fetch_json` answers /stats and /v1/models, the
router's session answers each proxied request with a scripted response.
"""

from __future__ import annotations

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from werkzeug.test import EnvironBuilder

from tests.scheduler.test_app import URL, FakeServers, stats
from tests.scheduler.test_app_operator import BODY, SSE, Answer, Session
from toppings.scheduler.app import create_app

URL2 = "http://10.0.0.2:8100"
STREAM = dict(BODY, stream=True)


@pytest.fixture
def setup(tmp_path, scheduler_parts):
    """A scheduler taking one request in flight at most, with two registered stand-in servers."""
    servers = FakeServers()
    with scheduler_parts(tmp_path, servers, Session()) as (_, cluster, router):
        app = create_app(router, cluster, {"perf_model_source": "test"}, max_in_flight=1)
        client = app.test_client()
        for url in (URL, URL2):
            servers.set(url, stats())
            assert client.post("/admin/servers", json={"url": url}).status_code == 201
        yield app, router.session, cluster


def metrics(client) -> dict[str, float]:
    text = client.get("/metrics").get_data(as_text=True)
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_past_its_limit_the_scheduler_answers_429_and_recovers(setup):
    app, session, _ = setup
    client, limit = app.test_client(), app.extensions["toppings"]
    session.script = [Answer(200, [SSE[:10], SSE[10:]])]
    held = client.post("/v1/completions", json=STREAM, buffered=False)
    assert next(iter(held.response)) == SSE[:10] and limit.num_in_flight == 1
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        refused = client.post(path, json=BODY)
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        error = refused.get_json()["error"]
        assert (error["code"], error["type"]) == (429, "too_many_requests")
    assert client.get("/health").status_code == 200 and client.get("/stats").status_code == 200
    m = metrics(client)
    assert m["toppings_scheduler:frontend_requests_in_flight"] == 1
    assert m["toppings_scheduler:max_concurrent_requests"] == 1
    assert m["toppings_scheduler:requests_rejected_total"] == 3
    held.close()
    assert limit.num_in_flight == 0
    session.script = [Answer(200, [b"{}"])]
    assert client.post("/v1/completions", json=BODY).status_code == 200
    assert limit.num_in_flight == 0


def test_the_slot_comes_back_on_every_path(setup):
    app, session, _ = setup
    client, limit = app.test_client(), app.extensions["toppings"]
    session.script = [Answer(404, [b'{"error": {}}']), Answer(404, [b'{"error": {}}']),
                      requests.ConnectionError("refused"),
                      requests.ConnectionError("refused")]  # fmt: skip
    assert client.post("/v1/completions", json=BODY).status_code == 404  # from both servers
    assert client.post("/v1/completions", json=BODY).status_code == 502  # both unreachable
    assert limit.num_in_flight == 0
    assert client.post("/v1/completions", json={"model": "ghost"}).status_code == 404
    assert client.post("/v1/completions", data=b"{nope").status_code == 400
    assert limit.num_in_flight == 0


def test_a_stream_closed_before_its_first_chunk_gives_the_slot_back(setup):
    app, session, _ = setup
    session.script = [Answer(200, [SSE[:10], SSE[10:]])]
    environ = EnvironBuilder(path="/v1/completions", method="POST", json=STREAM).get_environ()
    app_iter = app(environ, lambda status, headers, exc_info=None: None)  # as waitress calls it
    assert app.extensions["toppings"].num_in_flight == 1
    app_iter.close()  # the client left before any chunk: the body was never iterated
    assert app.extensions["toppings"].num_in_flight == 0 and session.answers[-1].closed


def test_a_busy_server_passes_the_request_on_and_all_busy_is_a_429(setup):
    app, session, cluster = setup
    client = app.test_client()
    session.script = [Answer(429, [b'{"error": {}}']), Answer(200, [b'{"ok": 1}'])]
    answer = client.post("/v1/completions", json=BODY)
    assert answer.status_code == 200 and answer.get_json() == {"ok": 1}
    assert all(s.healthy for s in cluster.states())  # busy is not unhealthy
    session.script = [Answer(429, [b'{"error": {}}']), Answer(429, [b'{"error": {}}'])]
    answer = client.post("/v1/completions", json=BODY)
    assert answer.status_code == 429 and int(answer.headers["Retry-After"]) >= 1
    assert answer.get_json()["error"]["type"] == "too_many_requests"
    assert all(s.healthy for s in cluster.states())
    assert app.extensions["toppings"].num_in_flight == 0


@pytest.mark.parametrize("order", ["down_first", "busy_first"])
def test_one_server_down_and_the_other_busy_is_a_429_not_a_502(setup, order):
    # the client may send it again in a moment: a 502 would read as a failure of the request
    app, session, _ = setup
    down, busy = requests.ConnectionError("refused"), Answer(429, [b'{"error": {}}'])
    session.script = [down, busy] if order == "down_first" else [busy, down]
    answer = app.test_client().post("/v1/completions", json=BODY)
    assert answer.status_code == 429 and int(answer.headers["Retry-After"]) >= 1
    assert answer.get_json()["error"]["type"] == "too_many_requests"
    assert app.extensions["toppings"].num_in_flight == 0


def test_one_model_holds_at_most_its_share_of_the_places_in_flight(tmp_path, scheduler_parts):
    # 4 places: one model holds 3, the fourth is kept for the others (TENANT_SHARE), from the
    # first request on, since the registered server holds adapters
    servers = FakeServers()
    with scheduler_parts(tmp_path, servers, Session()) as (_, cluster, router):
        app = create_app(router, cluster, {"perf_model_source": "test"}, max_in_flight=4)
        client, limit = app.test_client(), app.extensions["toppings"]
        servers.set(URL, stats())
        assert client.post("/admin/servers", json={"url": URL}).status_code == 201
        router.session.script = [Answer(200, [SSE[:10], SSE[10:]]) for _ in range(3)]
        held = [client.post("/v1/completions", json=STREAM, buffered=False) for _ in range(3)]
        assert all(next(iter(h.response)) == SSE[:10] for h in held)
        refused = client.post("/v1/completions", json=BODY)
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        assert "model 'sql' has 3 requests in flight" in refused.get_json()["error"]["message"]
        router.session.script = [Answer(200, [b"{}"])]
        other = client.post("/v1/completions", json=dict(BODY, model="chat"))
        assert other.status_code == 200 and limit.num_in_flight == 3
        for h in held:
            h.close()
        assert limit.num_in_flight == 0
        router.session.script = [Answer(200, [b"{}"])]
        assert client.post("/v1/completions", json=BODY).status_code == 200


def test_a_cluster_of_the_base_model_alone_keeps_its_whole_limit(tmp_path, scheduler_parts):
    # no server holds an adapter or finds them: one tenant, whatever model names clients send
    servers = FakeServers()
    with scheduler_parts(tmp_path, servers, Session()) as (_, cluster, router):
        app = create_app(router, cluster, {"perf_model_source": "test"}, max_in_flight=4)
        client, limit = app.test_client(), app.extensions["toppings"]
        servers.set(URL, stats(adapters=()))
        assert client.post("/admin/servers", json={"url": URL}).status_code == 201
        assert client.post("/v1/completions", json=dict(BODY, model="typo")).status_code == 404
        router.session.script = [Answer(200, [SSE[:10], SSE[10:]]) for _ in range(4)]
        base = dict(STREAM, model="tiny-llama")
        held = [client.post("/v1/completions", json=base, buffered=False) for _ in range(4)]
        assert [h.status_code for h in held] == [200] * 4 and limit.num_in_flight == 4
        for h in held:
            h.close()
        assert limit.num_in_flight == 0


def test_a_404_for_an_adapter_goes_on_to_the_next_server_and_the_last_one_is_answered(setup):
    # the adapter left the first server since its last /stats: the other one still has it
    app, session, _ = setup
    client = app.test_client()
    missing = Answer(404, [b'{"error": {"code": 404}}'])
    session.script = [missing, Answer(200, [b'{"ok": 1}'])]
    answer = client.post("/v1/completions", json=BODY)
    assert answer.status_code == 200 and answer.get_json() == {"ok": 1} and missing.closed
    session.script = [Answer(404, [b'{"error": {"code": 404}}']) for _ in range(2)]
    answer = client.post("/v1/completions", json=BODY)  # gone everywhere: the last 404
    assert answer.status_code == 404
    assert app.extensions["toppings"].num_in_flight == 0
