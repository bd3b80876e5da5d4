"""Scheduler operator endpoints (/health, /stats, /metrics) and the in-flight count.

The server is a stand-in: `fetch_json` answers /stats and /v1/models, and the router's session
answers each proxied request with a scripted response, so every way a request can end (read
whole, refused, failed mid-stream, client gone before or during the stream) is reproducible.
"""

from __future__ import annotations

import json

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.scheduler.test_app import URL, FakeServers, assert_error, stats
from toppings.scheduler.app import create_app

SSE = b"".join(b"data: " + json.dumps({"t": i}).encode() + b"\n\n" for i in range(3))
SSE += b"data: [DONE]\n\n"
BODY = {"model": "sql", "prompt": "hello", "max_tokens": 4}


class Answer:
    """A requests.Response stand-in: a status and a body in chunks, maybe failing midway."""

    def __init__(self, status: int, chunks: list[bytes], fail_after: int | None = None):
        self.status_code, self.ok = status, status < 400
        self.url, self.reason = "http://stand-in/", "REASON"
        ctype = "text/event-stream" if len(chunks) > 1 else "application/json"
        self.headers = {"Content-Type": ctype}
        self.chunks, self.fail_after = chunks, fail_after
        self.closed = False

    @property
    def content(self) -> bytes:
        return b"".join(self.iter_content())

    def json(self):
        return json.loads(self.content)

    def iter_content(self, chunk_size=None):
        for i, chunk in enumerate(self.chunks):
            if i == self.fail_after:
                raise requests.exceptions.ChunkedEncodingError("connection broken")
            yield chunk

    def raise_for_status(self) -> None:
        if self.status_code >= 400:
            raise requests.HTTPError(f"{self.status_code} from the stand-in")

    def close(self) -> None:
        self.closed = True


class Session:
    """Answers each post with the next scripted Answer (or raises the scripted exception)."""

    def __init__(self) -> None:
        self.script: list = []
        self.answers: list[Answer] = []
        self.urls: list[str] = []  # where each post went

    def post(self, url, json=None, data=None, headers=None, stream=False, timeout=None):
        self.urls.append(url)
        item = self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        self.answers.append(item)
        return item


@pytest.fixture
def setup(tmp_path, scheduler_parts):
    servers = FakeServers()
    with scheduler_parts(tmp_path, servers, Session()) as (_, cluster, router):
        app = create_app(router, cluster, {"perf_model_source": "test"})
        yield app.test_client(), servers, router.session


def register(client, servers) -> None:
    servers.set(URL, stats())
    assert client.post("/admin/servers", json={"url": URL}).status_code == 201


def in_flight(client) -> int:
    (server,) = client.get("/admin/state").get_json()["servers"]
    assert client.get("/stats").get_json()["servers"][0]["in_flight"] == server["in_flight"]
    return server["in_flight"]


def metrics(client) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of every sample of /metrics."""
    answer = client.get("/metrics")
    assert answer.status_code == 200 and answer.content_type.startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(answer.get_data(as_text=True))
        for s in family.samples
    }


def test_health_is_503_until_a_server_is_registered(setup):
    client, servers, _ = setup
    answer = client.get("/health")
    assert answer.status_code == 503 and answer.headers["Retry-After"]
    assert answer.get_json()["error"] == {
        "message": "no server ready yet", "type": "unavailable", "code": 503
    }  # fmt: skip
    register(client, servers)
    assert client.get("/health").get_json() == {"status": "ok", "num_servers": 1, "num_healthy": 1}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_requests_before_any_server_get_503_with_retry_after(setup, path):
    client, *_ = setup
    answer = client.post(path, json=BODY)
    assert answer.status_code == 503 and int(answer.headers["Retry-After"]) >= 1
    assert answer.get_json()["error"]["message"] == "no server ready yet"
    assert answer.get_json()["error"]["type"] == "unavailable"


def test_stats_lists_servers_policy_and_sizes(setup):
    client, servers, _ = setup
    assert client.get("/stats").get_json()["num_servers"] == 0
    register(client, servers)
    got = client.get("/stats").get_json()
    assert got["policy"] == "rank-aware"
    assert got["servers"] == [{"url": URL, "ready": True, "in_flight": 0}]
    assert (got["num_servers"], got["num_ready"], got["num_in_flight"]) == (1, 1, 0)
    assert (got["num_adapters"], got["num_base_models"]) == (2, 1)


def test_metrics_count_routing_outcomes_and_sizes(setup):
    client, servers, session = setup
    before = metrics(client)
    assert before[("toppings_scheduler:servers", ())] == 0
    assert not any(name.endswith("_created") for name, _ in before)
    register(client, servers)
    session.script = [Answer(200, [b'{"usage": {"completion_tokens": 4}}']),
                      Answer(400, [b'{"error": {}}'])]  # fmt: skip
    assert client.post("/v1/completions", json=BODY).status_code == 200
    assert client.post("/v1/completions", json=BODY).status_code == 400
    m = metrics(client)
    labels = (("policy", "rank-aware"), ("server", URL))
    assert m[("toppings_scheduler:requests_routed_total", labels)] == 2
    success = (("outcome", "success"), ("status", "200"))
    assert m[("toppings_scheduler:requests_finished_total", success)] == 1
    error = (("outcome", "error"), ("status", "400"))
    assert m[("toppings_scheduler:requests_finished_total", error)] == 1
    assert m[("toppings_scheduler:routing_decision_seconds_count", ())] == 2
    http = (("endpoint", "completions"), ("status", "200"))
    assert m[("toppings_scheduler:http_requests_total", http)] == 1
    assert m[("toppings_scheduler:servers", ())] == 1
    assert m[("toppings_scheduler:servers_healthy", ())] == 1
    assert m[("toppings_scheduler:adapters", ())] == 2
    assert m[("toppings_scheduler:num_requests_in_flight", (("server", URL),))] == 0


def test_in_flight_returns_to_zero_on_every_path(setup):
    client, servers, session = setup
    register(client, servers)
    stream = dict(BODY, stream=True)
    # Non-streamed: success, the server's error, the server unreachable (a 502 here).
    session.script = [Answer(200, [b"{}"]), Answer(404, [b'{"error": {}}']),
                      requests.ConnectionError("refused")]  # fmt: skip
    assert client.post("/v1/completions", json=BODY).status_code == 200
    assert client.post("/v1/completions", json=BODY).status_code == 404
    assert client.post("/v1/completions", json=BODY).status_code == 502
    assert in_flight(client) == 0
    servers.set(URL, stats())  # healthy again after the refusal
    client.post("/admin/servers", json={"url": URL})

    # Streamed to its end.
    session.script = [Answer(200, [SSE[:10], SSE[10:]])]
    assert client.post("/v1/completions", json=stream).data == SSE
    assert in_flight(client) == 0 and session.answers[-1].closed

    # The client goes away before the first chunk: the body iterator is closed, never started.
    session.script = [Answer(200, [SSE[:10], SSE[10:]])]
    answer = client.post("/v1/completions", json=stream, buffered=False)
    assert in_flight(client) == 1  # the answer is open until the client reads or leaves
    answer.close()
    assert in_flight(client) == 0 and session.answers[-1].closed

    # The client goes away mid-stream.
    session.script = [Answer(200, [SSE[:10], SSE[10:20], SSE[20:]])]
    answer = client.post("/v1/chat/completions", json=stream, buffered=False)
    assert next(iter(answer.response)) == SSE[:10]
    answer.close()
    assert in_flight(client) == 0 and session.answers[-1].closed

    # The server's connection breaks mid-stream.
    session.script = [Answer(200, [SSE[:10], SSE[10:]], fail_after=1)]
    answer = client.post("/generate", json={"adapter": "sql", "prompt": "x", "stream": True},
                         buffered=False)  # fmt: skip
    *passed, tail = list(answer.response)  # no exception: an error event and [DONE] end it
    assert passed == [SSE[:10]]
    assert tail.startswith(b"\n\ndata: ")  # the event cut short ends before the error's
    error = json.loads(tail.strip().split(b"\n\n")[0][6:])["error"]
    assert (error["code"], error["type"]) == (502, "bad_gateway")
    assert tail.endswith(b"data: [DONE]\n\n")
    answer.close()
    assert in_flight(client) == 0 and session.answers[-1].closed

    m = metrics(client)
    for outcome, count in (("success", 2), ("error", 2), ("disconnected", 2)):
        got = sum(v for (name, labels), v in m.items()
                  if name == "toppings_scheduler:requests_finished_total"
                  and dict(labels)["outcome"] == outcome)  # fmt: skip
        assert got == count, outcome


def test_an_adapter_no_named_server_loads_is_a_502_and_not_recorded(setup):
    client, servers, session = setup
    register(client, servers)
    session.script = [requests.ConnectionError("refused")]
    body = {"name": "law", "base_model": "tiny-llama", "rank": 8, "path": "/a/law",
            "servers": [URL]}  # fmt: skip
    answer = client.post("/admin/adapters", json=body)
    assert (
        answer.status_code == 502
        and "no server loaded 'law'" in answer.get_json()["error"]["message"]
    )
    assert "law" not in client.get("/admin/state").get_json()["adapters"]


def test_a_load_a_server_refuses_says_why_in_its_words(setup):
    client, servers, session = setup
    register(client, servers)
    refusal = {"error": {"message": "'lora_path' is outside the allowed adapter directories",
                         "type": "permission_denied", "code": 403}}  # fmt: skip
    session.script = [Answer(403, [json.dumps(refusal).encode()])]
    body = {"name": "law", "base_model": "tiny-llama", "rank": 8, "path": "/a/law",
            "servers": [URL]}  # fmt: skip
    answer = client.post("/admin/adapters", json=body)
    assert answer.status_code == 502
    assert (
        "403 from http://stand-in/: 'lora_path' is outside the allowed adapter directories"
        in (answer.get_json()["error"]["message"])
    )


def test_a_name_no_server_reported_goes_to_a_server_that_finds_names(setup):
    """An adapter no server hosts (never seen, or unloaded) is routed to a server with a
    resolver, which loads it on first use; without one it is a 404, answered here."""
    client, servers, session = setup
    body = stats()
    servers.set(URL, body)
    assert client.post("/admin/servers", json={"url": URL}).status_code == 201
    ask = {"model": "newcomer", "prompt": "hello", "max_tokens": 4}
    assert_error(client.post("/v1/completions", json=ask), 404, "not_found")
    assert not session.answers
    servers.set(URL, {**body, "lora_resolver": True})  # read again when registered again
    assert client.post("/admin/servers", json={"url": URL}).status_code == 201
    session.script = [Answer(200, [b'{"usage": {"completion_tokens": 4}}'])]
    assert client.post("/v1/completions", json=ask).status_code == 200
    assert session.answers  # it went to the server
    bad = {**ask, "model": "../etc"}
    assert_error(client.post("/v1/completions", json=bad), 404, "not_found")


def test_a_name_being_found_stays_with_the_server_finding_it(setup):
    """A request for a name no server reported goes to a server that finds names; those that
    follow go to the same one, though another now looks idler (it would load the name a second
    time), until it answers 404 for the name."""
    client, servers, session = setup
    other = "http://10.0.0.2:8100"
    for url in (URL, other):  # equal: the first registered wins the tie
        servers.set(url, {**stats(), "lora_resolver": True})
        assert client.post("/admin/servers", json={"url": url}).status_code == 201
    ask = {"model": "newcomer", "prompt": "hello", "max_tokens": 4}
    session.script = [Answer(200, [b"{}"]) for _ in range(3)] + [Answer(404, [b'{"error": {}}'])]
    assert client.post("/v1/completions", json=ask).status_code == 200
    busy = stats()
    busy["running"] = busy["running"] * 8
    servers.set(URL, {**busy, "lora_resolver": True})  # read again when registered again
    assert client.post("/admin/servers", json={"url": URL}).status_code == 201
    for _ in range(2):
        assert client.post("/v1/completions", json=ask).status_code == 200
    assert client.post("/v1/completions", json=ask).status_code == 404  # not found there
    assert session.urls == [URL + "/v1/completions"] * 4
    session.script = [Answer(200, [b"{}"])]
    assert client.post("/v1/completions", json=ask).status_code == 200
    assert session.urls[-1] == other + "/v1/completions"  # the idler one, now


def test_a_loaded_adapter_is_routed_at_once_and_loading_again_is_fine(setup):
    """After POST /admin/adapters loads it, the server's /stats is read again: a request right
    after is routed (it was a 404 until the next poll); a server that has it already (409)
    counts as loaded."""
    client, servers, session = setup
    register(client, servers)
    servers.set(URL, stats(adapters=(("sql", 16), ("chat", 64), ("law", 8))))  # once loaded
    body = {"name": "law", "base_model": "tiny-llama", "rank": 8, "path": "/a/law",
            "servers": [URL]}  # fmt: skip
    session.script = [Answer(200, [b"{}"]), Answer(200, [b'{"usage": {"completion_tokens": 1}}']),
                      Answer(409, [b'{"error": {}}'])]  # fmt: skip
    assert client.post("/admin/adapters", json=body).status_code == 201
    ask = {"model": "law", "prompt": "hello", "max_tokens": 1}
    assert client.post("/v1/completions", json=ask).status_code == 200
    again = client.post("/admin/adapters", json=body)
    assert again.status_code == 201 and again.get_json()["loaded_on"] == [URL]
