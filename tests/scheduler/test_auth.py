"""Who may call the scheduler: the client key, the admin key, and /admin to loopback only.

The Flask test client plays the clients (its `REMOTE_ADDR` is 127.0.0.1 unless a test sets
another); servers are stand-ins as in test_app (`fetch_json`).
"""

from __future__ import annotations

import contextlib
import logging
import threading

import pytest

from tests.scheduler.test_app import URL, FakeServers, assert_error, stats
from toppings.scheduler.app import create_app
from toppings.scheduler.auth import AccessKeys, is_loopback, is_loopback_host

CLIENT_KEY = "client-key"
ADMIN_KEY = "admin-key"
BODY = {"model": "sql", "prompt": "hello", "max_tokens": 4}
ELSEWHERE = {"REMOTE_ADDR": "10.1.2.3"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def ready_servers() -> FakeServers:
    """Stand-ins with one ready server at URL."""
    servers = FakeServers()
    servers.set(URL, stats())
    return servers


@contextlib.contextmanager
def make_client(scheduler_parts, root, keys: AccessKeys):
    """A test client of a scheduler with these keys over ready_servers()."""
    with scheduler_parts(root, ready_servers()) as (_, cluster, router):
        yield create_app(router, cluster, {"perf_model_source": "test"}, keys=keys).test_client()


@pytest.fixture
def keyed(tmp_path, scheduler_parts):
    with make_client(scheduler_parts, tmp_path, AccessKeys(CLIENT_KEY, ADMIN_KEY)) as client:
        yield client


@pytest.fixture
def no_admin_key(tmp_path, scheduler_parts):
    with make_client(scheduler_parts, tmp_path, AccessKeys(CLIENT_KEY)) as client:
        yield client


@pytest.mark.parametrize(
    "method, path",
    [("post", "/v1/completions"), ("post", "/v1/chat/completions"), ("post", "/generate"),
     ("get", "/v1/models"), ("get", "/stats"), ("get", "/metrics"), ("get", "/admin/state"),
     ("post", "/admin/servers"), ("delete", "/admin/servers"), ("get", "/no/such/route")],
)  # fmt: skip
def test_without_a_key_every_path_but_health_is_401(keyed, method, path):
    answer = getattr(keyed, method)(path, json=BODY)
    error = assert_error(answer, 401, "authentication_error")
    assert "Authorization: Bearer" in error["message"]
    wrong = getattr(keyed, method)(path, json=BODY, headers=bearer("not-the-key"))
    assert_error(wrong, 401, "authentication_error")
    assert keyed.get("/health").status_code == 503  # open: "no server ready yet"


def test_the_client_key_opens_the_request_paths_not_admin(keyed):
    assert keyed.get("/stats", headers=bearer(CLIENT_KEY)).status_code == 200
    assert keyed.get("/metrics", headers=bearer(CLIENT_KEY)).status_code == 200
    assert keyed.get("/v1/models", headers=bearer(CLIENT_KEY)).status_code == 200
    for method, path in (("get", "/admin/state"), ("post", "/admin/servers")):
        refused = getattr(keyed, method)(path, json={"url": URL}, headers=bearer(CLIENT_KEY))
        error = assert_error(refused, 401, "authentication_error")
        assert "admin key" in error["message"]
    assert keyed.get("/admin/state", headers=bearer(ADMIN_KEY)).get_json()["servers"] == []


def test_the_admin_key_opens_admin_only(keyed):
    added = keyed.post("/admin/servers", json={"url": URL}, headers=bearer(ADMIN_KEY))
    assert added.status_code == 201
    assert keyed.get("/admin/state", headers=bearer(ADMIN_KEY)).status_code == 200
    assert_error(keyed.get("/stats", headers=bearer(ADMIN_KEY)), 401, "authentication_error")
    assert keyed.get("/health").status_code == 200


@pytest.mark.parametrize(
    "header", ["Bearer cl\u00e9", "Bearer \u00ff\u00fe", "bearer  client-key "]
)
def test_a_non_ascii_or_odd_bearer_is_judged_not_crashed_on(keyed, header):
    answer = keyed.get("/stats", headers={"Authorization": header})
    if header.strip().endswith(CLIENT_KEY):  # scheme and spaces are forgiven, as on the server
        assert answer.status_code == 200
    else:
        assert_error(answer, 401, "authentication_error")
    admin = keyed.get("/admin/state", headers={"Authorization": header})
    assert_error(admin, 401, "authentication_error")


def test_without_an_admin_key_admin_answers_loopback_only(no_admin_key):
    client = no_admin_key
    refused = client.get("/admin/state", environ_base=ELSEWHERE)
    error = assert_error(refused, 403, "permission_denied")
    assert "--admin-api-key" in error["message"]
    refused = client.post("/admin/servers", json={"url": URL}, environ_base=ELSEWHERE,
                          headers=bearer(CLIENT_KEY))  # fmt: skip
    assert_error(refused, 403, "permission_denied")
    assert client.get("/admin/state").status_code == 200  # 127.0.0.1
    six = client.get("/admin/state", environ_base={"REMOTE_ADDR": "::1"})
    assert six.status_code == 200
    # The client key still guards the request paths, from anywhere.
    assert_error(client.get("/stats", environ_base=ELSEWHERE), 401, "authentication_error")
    ok = client.get("/stats", environ_base=ELSEWHERE, headers=bearer(CLIENT_KEY))
    assert ok.status_code == 200


def test_without_any_key_the_request_paths_are_open_and_admin_is_loopback(
    tmp_path, scheduler_parts
):
    with make_client(scheduler_parts, tmp_path, AccessKeys()) as client:
        assert client.get("/stats", environ_base=ELSEWHERE).status_code == 200
        assert client.post("/admin/servers", json={"url": URL}).status_code == 201
        refused = client.delete("/admin/servers", json={"url": URL}, environ_base=ELSEWHERE)
        assert_error(refused, 403, "permission_denied")
        assert client.get("/health").status_code == 200  # the server is still there


@pytest.mark.parametrize(
    "address, loopback",
    [("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("::ffff:127.0.0.1", True),
     ("10.0.0.1", False), ("::ffff:10.0.0.1", False), ("fe80::1", False), ("", False),
     (None, False), ("localhost", False)],
)  # fmt: skip
def test_loopback_peers(address, loopback):
    assert is_loopback(address) is loopback


def test_loopback_hosts():
    assert is_loopback_host("127.0.0.1") and is_loopback_host("localhost")
    assert is_loopback_host("::1")
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("10.0.0.1")


def test_the_launcher_registers_with_the_admin_key(tmp_path, monkeypatch, scheduler_parts):
    from werkzeug.serving import make_server

    from toppings.scripts.launch.node import scheduler_admin_key, scheduler_call

    with scheduler_parts(tmp_path, ready_servers()) as (_, cluster, router):
        app = create_app(router, cluster, {}, keys=AccessKeys(admin_api_key=ADMIN_KEY))
        http = make_server("127.0.0.1", 0, app, threaded=True)
        thread = threading.Thread(target=http.serve_forever, daemon=True)
        thread.start()
        scheduler = f"http://127.0.0.1:{http.server_port}"
        try:
            monkeypatch.delenv("TOPPINGS_ADMIN_API_KEY", raising=False)
            assert scheduler_admin_key([]) is None
            assert not scheduler_call("post", scheduler, URL)  # 401 without the key
            monkeypatch.setenv("TOPPINGS_ADMIN_API_KEY", ADMIN_KEY)
            assert scheduler_admin_key(["--policy=random"]) == ADMIN_KEY
            assert scheduler_admin_key(["--admin-api-key=k2"]) == "k2"
            assert scheduler_admin_key(["--admin-api-key", "k3"]) == "k3"
            assert scheduler_call("post", scheduler, URL, scheduler_admin_key([]))
            assert cluster.urls() == [URL]
            assert scheduler_call("delete", scheduler, URL, ADMIN_KEY) and cluster.urls() == []
        finally:
            http.shutdown()


def test_one_warning_off_loopback_without_an_admin_key(caplog):
    from toppings.scheduler.cli import warn_if_admin_unreachable

    with caplog.at_level(logging.WARNING, logger="toppings-scheduler"):
        warn_if_admin_unreachable("127.0.0.1", AccessKeys())
        warn_if_admin_unreachable("0.0.0.0", AccessKeys(admin_api_key=ADMIN_KEY))
        assert caplog.records == []
        warn_if_admin_unreachable("0.0.0.0", AccessKeys(api_key=CLIENT_KEY))
    assert len(caplog.records) == 1 and "--admin-api-key" in caplog.records[0].getMessage()


@pytest.mark.parametrize("flag", ["--api-key", "--admin-api-key", "--server-api-key"])
def test_an_empty_key_is_a_usage_error(tmp_path, flag, capsys):
    from toppings.scheduler.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--registry", str(tmp_path / "r.sqlite"), flag, ""])
    assert exit_.value.code == 2 and "an empty key" in capsys.readouterr().err
    assert not (tmp_path / "r.sqlite").exists()  # refused before anything was opened
