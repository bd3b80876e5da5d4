"""One error contract: the same bad input gets the same answer from the scheduler and a server.

A real server app (tiny random Llama, one adapter) runs in-process behind Flask's test client;
the scheduler reaches it through a session and a `fetch_json` that call that test client, so no
socket is opened. Also checks the DESIGN rule that the scheduler knows servers only through HTTP:
its modules import nothing of toppings.server but the HTTP contract (errors, stats_schema).
"""

from __future__ import annotations

import ast
import io
import logging
import re
from json import dumps
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from toppings.scheduler.app import create_app as create_scheduler
from toppings.server.api.app import create_app as create_server

URL = "http://server.test:8100"
SCHEDULER_DIR = Path(__file__).resolve().parents[2] / "scheduler"


class FlaskSession:
    """The part of requests.Session the router uses, answered by a Flask test client."""

    def __init__(self, client):
        self.client = client

    def post(
        self, url: str, json=None, data=None, headers=None, stream=False, timeout=None
    ) -> requests.Response:
        if json is not None:  # as requests writes it: a NaN is its InvalidJSONError, not sent
            try:
                data, headers = dumps(json, allow_nan=False), {"Content-Type": "application/json"}
            except ValueError as exc:
                raise requests.exceptions.InvalidJSONError(str(exc)) from exc
        answer = self.client.post(urlsplit(url).path, data=data, headers=headers)
        response = requests.Response()
        response.status_code = answer.status_code
        response.headers.update(answer.headers)
        response.raw = io.BytesIO(answer.data)  # read whole or streamed, as the router asks
        return response


@pytest.fixture(scope="module")
def clients(tmp_path_factory, tiny_model_dir, tiny_engine, scheduler_parts):
    from toppings.scripts.make_adapters import make_random_adapter

    root = tmp_path_factory.mktemp("contract")
    lora = make_random_adapter(root / "a8", tiny_model_dir, rank=8, seed=0)
    with tiny_engine({"a8": str(lora)}, max_total_tokens=2048) as engine:
        server = create_server(engine).test_client()

        def fetch_json(url: str) -> dict:
            return server.get(urlsplit(url).path).get_json()

        with scheduler_parts(root, fetch_json, FlaskSession(server)) as (_, cluster, router):
            scheduler = create_scheduler(router, cluster, {}).test_client()
            assert scheduler.post("/admin/servers", json={"url": URL}).status_code == 201
            yield scheduler, server


CHAT = [{"role": "user", "content": "hi"}]
BAD_INPUTS = [
    ("/v1/completions", b"{nope"),
    ("/v1/completions", [1, 2]),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}),
    ("/v1/completions", {"model": 5, "prompt": "hi"}),
    ("/v1/completions", {"model": "a8", "prompt": "hi", "max_tokens": 0}),
    ("/v1/completions", {"model": "a8", "prompt": "hi", "max_tokens": "many"}),
    ("/v1/completions", {"model": "a8", "prompt": "hi", "max_tokens": 10**9}),
    ("/v1/completions", {"model": "a8", "prompt": {"text": "hi"}}),
    ("/v1/completions", {"model": "a8", "prompt": "hi", "temperature": -1}),
    ("/v1/completions", {"model": "a8", "prompt": "hi", "n": 99}),
    ("/v1/completions", {"model": "a8", "prompt": "hi", "logprobs": -1}),
    ("/v1/completions", {"model": "a8", "prompt": "hi", "logit_bias": {"999999": 5}}),
    ("/v1/completions", {"model": "a8", "prompt": ["hi", 3]}),
    ("/v1/chat/completions", {"model": "nope", "messages": CHAT}),
    ("/v1/chat/completions", {"model": "a8", "messages": []}),
    ("/v1/chat/completions", {"model": "a8", "messages": CHAT, "max_completion_tokens": -3}),
    ("/v1/completions", b'{"model": "a8", "prompt": "hi", "temperature": NaN}'),
    ("/v1/chat/completions", b'{"model": "a8", "messages": [], "tools": [{"x": -Infinity}]}'),
    ("/v1/completions", b'{"model": "a8", "prompt": "hi", "top_p": 1e999}'),
    ("/generate", b"[]"),
    ("/generate", {"adapter": "nope", "prompt": "hi"}),
    ("/generate", {"prompt": "hi", "input_ids": [1, 2]}),
    ("/generate", {"adapter": "a8", "prompt": "hi", "max_new_tokens": 0}),
]


@pytest.mark.parametrize(("path", "body"), BAD_INPUTS)
def test_same_bad_input_same_error(clients, path, body):
    scheduler, server = clients
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    via_scheduler, direct = scheduler.post(path, **kwargs), server.post(path, **kwargs)
    assert 400 <= direct.status_code < 500
    assert via_scheduler.status_code == direct.status_code
    assert via_scheduler.get_json() == direct.get_json()
    error = direct.get_json()["error"]
    assert set(error) == {"message", "type", "code"} and error["code"] == direct.status_code


def test_a_body_with_nan_fails_no_server(clients):
    # A NaN, which Python's json reads and requests refuses to write, made the scheduler mark
    # the server it tried unhealthy: every other client's request then got a 503.
    scheduler, _ = clients
    for _ in range(3):
        answer = scheduler.post("/v1/completions", data=b'{"model": "a8", "top_p": NaN}')
        assert answer.status_code == 400 and "NaN" in answer.get_json()["error"]["message"]
    body = {"model": "a8", "prompt": "hi", "max_tokens": 1}
    assert scheduler.post("/v1/completions", json=body).status_code == 200


DEEP = 100_000
PROXIED_PATHS = ["/v1/completions", "/v1/chat/completions", "/generate", "/tokenize", "/detokenize"]


@pytest.mark.parametrize("path", PROXIED_PATHS)
def test_deep_body_is_the_same_400_on_both(clients, path):
    # Issue 48: 100,000 levels of nesting were a 500 RecursionError on every JSON route.
    scheduler, server = clients
    body = b"[" * DEEP + b"]" * DEEP
    via_scheduler, direct = scheduler.post(path, data=body), server.post(path, data=body)
    assert direct.status_code == 400 == via_scheduler.status_code
    assert via_scheduler.get_json() == direct.get_json()
    assert "levels" in direct.get_json()["error"]["message"]


@pytest.mark.parametrize(
    ("method", "path"),
    [("post", "/admin/servers"), ("delete", "/admin/servers"), ("post", "/admin/adapters")],
)
def test_deep_admin_body_is_a_400(clients, method, path):
    scheduler, _ = clients
    body = ('{"url": ' + '{"a":' * DEEP + "1" + "}" * DEEP + "}").encode()
    answer = getattr(scheduler, method)(path, data=body)
    assert answer.status_code == 400
    assert "levels" in answer.get_json()["error"]["message"]


def test_a_missing_model_means_the_base_model_on_both(clients):
    scheduler, server = clients
    body = {"prompt": "hi", "max_tokens": 2, "ignore_eos": True}
    for client in (scheduler, server):
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200 and answer.get_json()["usage"]["completion_tokens"] == 2


def _toppings_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n.startswith("toppings.")}


# The error body, the bound on client JSON, the KV events' block hash, the /stats body, the
# front end that refuses past the in-flight limit with 429 + Retry-After, and the waitress server
# with its header deadline (shared so that both processes bound, refuse and hash alike); the
# listen flags, the one /metrics route and the flag generator both commands are built from.
HTTP_CONTRACT = (
    "toppings.server.requests.errors",
    "toppings.server.requests.json_depth",
    "toppings.server.kv_events.block_hash",
    "toppings.server.requests.stats_schema",
    "toppings.server.http.frontend",
    "toppings.server.http.waitress_server",
    "toppings.server.http.drain",
    "toppings.server.http.listen",
    "toppings.server.http.metrics",
    "toppings.server.settings",
)


def test_scheduler_imports_only_the_http_contract_of_the_server():
    modules = sorted(SCHEDULER_DIR.rglob("*.py"))
    assert len(modules) > 5
    for path in modules:
        for name in _toppings_imports(path):
            if name.startswith("toppings.server"):
                assert name.startswith(HTTP_CONTRACT), f"{path.name} imports {name}"


@pytest.mark.parametrize(
    "module",
    [
        "requests/errors.py",
        "requests/json_depth.py",
        "kv_events/block_hash.py",
        "requests/stats_schema.py",
        "http/frontend.py",
        "http/waitress_server.py",
        "http/listen.py",
        "http/metrics.py",
        "settings.py",
    ],
)
def test_the_http_contract_imports_nothing_of_toppings_but_itself(module):
    for name in _toppings_imports(SCHEDULER_DIR.parent / "server" / module):
        assert name.startswith(HTTP_CONTRACT), f"{module} imports {name}"


def test_the_tool_format_header_passes_through_the_scheduler(clients):
    # The tiny model's template does not render tools: the server says it used the generic
    # format, and a client of the scheduler reads the same header.
    scheduler, server = clients
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"messages": CHAT, "tools": tools, "tool_choice": "none", "max_tokens": 2}
    for client in (server, scheduler):
        answer = client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.get_data(as_text=True)
        assert answer.headers["X-Toppings-Tool-Format"] == "generic"


def test_every_answer_carries_the_request_id_and_both_processes_log_it(clients, caplog):
    scheduler, server = clients
    body = {"model": "a8", "prompt": "hi", "max_tokens": 1}
    sent = scheduler.post("/v1/completions", json=body, headers={"X-Request-Id": "trace-7"})
    assert sent.status_code == 200 and sent.headers["X-Request-Id"] == "trace-7"
    for headers in ({}, {"X-Request-Id": "x" * 129}, {"X-Request-Id": "two words"}):
        for client in (scheduler, server):  # none, or one not usable: one is made
            made = client.post("/v1/completions", json=body, headers=headers)
            assert re.fullmatch(r"[0-9a-f]{32}", made.headers["X-Request-Id"]), headers
    with caplog.at_level(logging.INFO):
        refused = scheduler.post("/v1/completions", json={**body, "max_tokens": 0},
                                 headers={"X-Request-Id": "trace-8"})  # fmt: skip
        unknown = scheduler.post("/v1/completions", json={**body, "model": "nope"},
                                 headers={"X-Request-Id": "trace-9"})  # fmt: skip
    assert refused.status_code == 400 and refused.headers["X-Request-Id"] == "trace-8"
    assert unknown.status_code == 404 and unknown.headers["X-Request-Id"] == "trace-9"
    logged = {(r.name, m) for r in caplog.records for m in ("[trace-8]", "[trace-9]")
              if m in r.getMessage()}  # fmt: skip
    # the server refused the first (the scheduler sent the id on), the scheduler the second
    assert ("toppings.server.api.app", "[trace-8]") in logged
    assert ("toppings.scheduler.app", "[trace-9]") in logged
