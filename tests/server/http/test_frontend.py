"""The in-flight limit of the HTTP front end (server.frontend): its parts alone, then through the
Flask test client on a tiny engine, where every way a generation request can end (finished,
refused, failed, client gone before or during the stream) must give its slot back: one slot that
leaks is a server that refuses everything once the limit is reached."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from werkzeug.test import EnvironBuilder

from tests.helpers import spy_on_submissions
from tests.server.api.test_api import start_engine
from toppings.server.api.app import ApiOptions, create_app
from toppings.server.http.frontend import (
    InFlightLimit,
    ReleasingBody,
    default_max_in_flight,
    waitress_settings,
)
from toppings.server.requests.request import RequestHandle

LIMIT = 2
LONG = 400  # new tokens: a request that is still generating while a test looks at it
ENDPOINTS = {
    "/generate": {"input_ids": [1, 2, 3], "max_new_tokens": 4, "ignore_eos": True},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4, "ignore_eos": True},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "ignore_eos": True,
    },  # fmt: skip
}


def test_limit_refuses_past_max_and_counts():
    limit = InFlightLimit(2)
    a, b = limit.try_acquire(), limit.try_acquire()
    assert a and b and limit.num_in_flight == 2
    assert limit.try_acquire() is None and limit.try_acquire() is None
    assert limit.num_rejected == 2
    a.release()
    a.release()  # idempotent: a second release gives back nothing more
    assert limit.num_in_flight == 1
    c = limit.try_acquire()
    assert c and limit.try_acquire() is None and limit.num_in_flight == 2
    b.release(), c.release()
    assert limit.num_in_flight == 0 and limit.num_rejected == 3
    with pytest.raises(ValueError):
        InFlightLimit(0)


def test_one_tenant_holds_at_most_its_share_and_the_rest_is_kept_for_others():
    several = [False]
    limit = InFlightLimit(8, tenant_share=0.75, several=lambda: several[0])
    assert limit.max_per_tenant == 6
    alone = [limit.try_acquire() for _ in range(8)]  # one tenant served: the limit is its own
    assert [limit.assign(s, "a", "a") for s in alone] == [None] * 8
    for slot in alone:
        slot.release()
    several[0] = True  # adapters came: the shares apply, to a flood that came first as well
    flood = [limit.try_acquire() for _ in range(7)]
    refusals = [limit.assign(s, "a", "adapter 'a'") for s in flood]
    assert refusals[:6] == [None] * 6 and "adapter 'a' has 6 requests in flight" in refusals[6]
    assert limit.tenant_in_flight("a") == 6 and limit.num_rejected == 1
    flood.pop().release()  # refused: the caller gives its slot back
    others = [limit.try_acquire() for _ in range(2)]
    assert all(limit.assign(s, "b", "b") is None for s in others)  # the kept quarter
    assert limit.try_acquire() is None  # the whole limit holds as before
    flood[0].release()
    flood[0].release()  # idempotent
    late = limit.try_acquire()
    assert late and limit.assign(late, "a", "a") is None and limit.tenant_in_flight("a") == 6
    for slot in [*flood, *others, late]:
        slot.release()
    assert limit.num_in_flight == 0 and limit.tenant_in_flight("a") == 0
    assert not limit._tenants  # no tenant kept once it holds nothing
    # small limits keep no quarter: a tenant may hold all of them
    assert [InFlightLimit(n, 0.75).max_per_tenant for n in (1, 2, 3, 4)] == [1, 2, 3, 3]


def test_limit_holds_under_concurrent_use():
    limit, peak, errors = InFlightLimit(5), [], []

    def worker():
        for _ in range(500):
            slot = limit.try_acquire()
            if slot is not None:
                peak.append(limit.num_in_flight)
                slot.release()
                slot.release()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and limit.num_in_flight == 0 and max(peak) <= 5


def test_releasing_body_closes_once_even_if_never_iterated():
    ran = []

    def chunks():
        try:
            yield b"a"
            yield b"b"
        finally:
            ran.append("generator")

    body = ReleasingBody(chunks(), lambda: ran.append("first"), lambda: ran.append("second"))
    body.close()
    body.close()
    assert ran == ["first", "second"]  # a generator never started has no finally to run
    body = ReleasingBody(chunks(), lambda: ran.append("released"))
    assert next(body) == b"a"
    body.close()
    assert ran[2:] == ["generator", "released"]


def test_releasing_body_runs_every_callback_when_one_fails():
    limit = InFlightLimit(1)
    slot = limit.try_acquire()

    def broken():
        raise RuntimeError("boom")

    body = ReleasingBody([b"x"], broken, slot.release)
    with pytest.raises(RuntimeError):
        body.close()
    assert limit.num_in_flight == 0


def test_a_dropped_body_releases_its_slot():
    limit = InFlightLimit(1)
    body = ReleasingBody(iter([b"x"]), limit.try_acquire().release)
    del body
    assert limit.num_in_flight == 0


def test_waitress_has_a_thread_per_request_in_flight_and_a_reserve():
    settings = waitress_settings(512, 8)
    assert settings["threads"] == 520 and settings["connection_limit"] > 520
    assert settings["asyncore_use_poll"]  # select() cannot watch sockets numbered past 1023
    assert default_max_in_flight(128) > 128


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_model_dir):
    with start_engine(tmp_path_factory.mktemp("frontend_adapters"), tiny_model_dir) as eng:
        yield eng


@pytest.fixture
def app(engine):
    """A fresh app (and limit) per test, LIMIT requests in flight at most."""
    yield create_app(engine, ApiOptions(max_concurrent_requests=LIMIT))
    assert_idle(engine)


def in_flight(app) -> int:
    return app.extensions["toppings"].in_flight.num_in_flight


def assert_idle(engine, timeout_s: float = 60.0) -> None:
    """Nothing running or queued: every request was finished or aborted."""
    deadline = time.monotonic() + timeout_s
    while (stats := engine.stats()).running or stats.queue:
        assert time.monotonic() < deadline, stats.to_json()
        time.sleep(0.02)


def open_stream(client, path: str = "/generate", max_new: int = LONG, adapter: str | None = None):
    """A streamed request, its first chunk read (the request is in flight), not closed."""
    body = dict(ENDPOINTS[path], stream=True)
    if adapter is not None:
        body["adapter"] = adapter
    body["max_new_tokens" if path == "/generate" else "max_tokens"] = max_new
    response = client.post(path, json=body, buffered=False)
    assert response.status_code == 200
    chunks = iter(response.response)
    assert next(chunks).startswith(b"data: {")
    return response


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("stream", [False, True])
def test_a_finished_request_gives_its_slot_back(app, path, stream):
    client = app.test_client()
    for _ in range(LIMIT + 1):  # more than the limit, one after the other
        response = client.post(path, json=dict(ENDPOINTS[path], stream=stream))
        assert response.status_code == 200
        assert response.get_data().endswith(b"data: [DONE]\n\n" if stream else b"}\n")
        assert in_flight(app) == 0


REFUSED = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/generate", {"adapter": "ghost", "prompt": "x"}, 404),  # refused by engine.submit
    ("/generate", {"input_ids": [3] * 4096, "max_new_tokens": 1}, 400),  # by engine.submit
]


@pytest.mark.parametrize("path, body, status", REFUSED)
def test_a_refused_request_gives_its_slot_back(app, path, body, status):
    kwargs = {"json": body} if isinstance(body, dict) else {"data": body}
    for stream in (False, True):
        if isinstance(body, dict):
            kwargs["json"] = dict(body, stream=stream)
        for _ in range(LIMIT + 1):
            assert app.test_client().post(path, **kwargs).status_code == status
            assert in_flight(app) == 0


def test_past_the_limit_a_429_with_retry_after_then_served_again(app):
    client = app.test_client()
    held = [open_stream(client, "/generate"), open_stream(client, "/v1/chat/completions")]
    assert in_flight(app) == LIMIT
    for path in ENDPOINTS:  # one limit for the three endpoints
        refused = client.post(path, json=ENDPOINTS[path])
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        error = refused.get_json()["error"]
        assert set(error) == {"message", "type", "code"}
        assert error["code"] == 429 and error["type"] == "too_many_requests"
        assert "--max-concurrent-requests" in error["message"]
    assert client.get("/health").status_code == 200  # operator endpoints take no slot
    stats = client.get("/stats").get_json()
    assert (stats["num_in_flight"], stats["max_concurrent_requests"]) == (LIMIT, LIMIT)
    metrics = metric_values(client)
    assert metrics["toppings:num_requests_in_flight"] == LIMIT
    assert metrics["toppings:max_concurrent_requests"] == LIMIT
    assert metrics["toppings:requests_rejected_total"] == 3
    for response in held:
        response.close()  # the client hangs up: aborted, slot back
    assert in_flight(app) == 0
    assert client.post("/generate", json=ENDPOINTS["/generate"]).status_code == 200
    assert metric_values(client)["toppings:num_requests_in_flight"] == 0


def test_one_adapter_past_its_share_gets_a_429_and_the_others_are_served(engine):
    # 4 in flight at most: one adapter (or the base model) holds 3, the fourth is kept for others
    app = create_app(engine, ApiOptions(max_concurrent_requests=4))
    client = app.test_client()
    held = [open_stream(client, "/generate", adapter="a8") for _ in range(3)]
    refused = client.post("/generate", json=dict(ENDPOINTS["/generate"], adapter="a8"))
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    message = refused.get_json()["error"]["message"]
    assert "adapter 'a8' has 3 requests in flight" in message and "3 of the 4" in message
    assert in_flight(app) == 3  # the refused request gave its slot back
    other = client.post("/generate", json=dict(ENDPOINTS["/generate"], adapter="a16"))
    assert other.status_code == 200
    base = client.post("/generate", json=ENDPOINTS["/generate"])
    assert base.status_code == 200
    for response in held:
        response.close()
    assert in_flight(app) == 0
    again = client.post("/generate", json=dict(ENDPOINTS["/generate"], adapter="a8"))
    assert again.status_code == 200
    assert_idle(engine)


def test_a_draining_server_answers_503_before_its_limit_does_429(app):
    client = app.test_client()
    held = [open_stream(client, "/generate"), open_stream(client, "/v1/chat/completions")]
    app.extensions["toppings"].draining.set()  # full and draining: the drain is the answer
    refused = client.post("/generate", json=ENDPOINTS["/generate"])
    assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
    assert "draining" in refused.get_json()["error"]["message"]
    for response in held:
        response.close()
    assert in_flight(app) == 0


def test_a_stream_the_client_closed_still_counts_its_tokens(app, engine):
    client = app.test_client()
    before = metric_values(client)
    response = open_stream(client, "/v1/completions")  # its first chunk read
    response.close()  # the client hangs up mid-stream: aborted
    assert_idle(engine)
    deadline = time.monotonic() + 30
    while (after := metric_values(client))["toppings:prompt_tokens_total"] == before[
        "toppings:prompt_tokens_total"
    ]:
        assert time.monotonic() < deadline, "the aborted stream's tokens were never counted"
        time.sleep(0.02)
    assert after["toppings:generation_tokens_total"] > before["toppings:generation_tokens_total"]


def metric_values(client) -> dict[str, float]:
    text = client.get("/metrics").get_data(as_text=True)
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture
def finals(engine, monkeypatch):
    """The final output of every request submitted during the test, as it ends."""
    ended = []

    def watched(req, handle):
        put = handle.put
        handle.put = lambda out: (put(out), out.finish_reason and ended.append(out))

    spy_on_submissions(engine, monkeypatch, watched)
    return ended


def wait_for(items: list, n: int = 1) -> None:
    deadline = time.monotonic() + 60
    while len(items) < n:
        assert time.monotonic() < deadline, "the request never ended"
        time.sleep(0.02)


@pytest.mark.parametrize("read_first", [False, True], ids=["before", "mid-stream"])
def test_a_client_gone_from_a_stream_aborts_and_gives_its_slot_back(app, finals, read_first):
    body = dict(ENDPOINTS["/generate"], stream=True, max_new_tokens=LONG)
    environ = EnvironBuilder(path="/generate", method="POST", json=body).get_environ()
    app_iter = app(environ, lambda status, headers, exc_info=None: None)  # as waitress calls it
    assert in_flight(app) == 1
    if read_first:
        assert next(iter(app_iter)).startswith(b"data: {")
    app_iter.close()  # what waitress does when the client hangs up, before any chunk or after
    assert in_flight(app) == 0
    wait_for(finals)
    assert finals[0].finish_reason == "abort" and finals[0].output_tokens < LONG


def test_a_client_gone_from_a_plain_request_gives_its_slot_back(app, finals):
    client = app.test_client()
    body = dict(ENDPOINTS["/generate"], max_new_tokens=LONG)
    gone = {"waitress.client_disconnected": lambda: True}  # as waitress reports a hang-up
    client.post("/generate", json=body, environ_base=gone)
    assert in_flight(app) == 0
    wait_for(finals)
    assert finals[0].finish_reason == "abort"


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_that_stops_answering_gives_the_slot_back(app, engine, monkeypatch, stream):
    """The engine dies with the request inside: no output ever comes (503, or an error event)."""
    monkeypatch.setattr(
        engine, "submit_all", lambda reqs: [RequestHandle(r, lambda rid: None) for r in reqs]
    )
    monkeypatch.setattr(engine, "is_healthy", lambda: False)
    response = app.test_client().post("/generate", json=dict(ENDPOINTS["/generate"], stream=stream))
    if stream:
        assert b"the engine stopped" in response.data and response.data.endswith(b"[DONE]\n\n")
    else:
        assert response.status_code == 503
    assert in_flight(app) == 0
