"""JSON nested past the server's bound (issue 48): every JSON route, and JSON text inside a
field (a guided_json string, a tool call's arguments), answers 400 naming the limit, found by a
scan before parsing; the server keeps serving."""

from __future__ import annotations

import json

import pytest

from toppings.server.api.app import ApiOptions, create_app
from toppings.server.requests.errors import MAX_JSON_DEPTH, nests_too_deep

DEEP = 100_000
DEEP_BODY = b"[" * DEEP + b"]" * DEEP
DEEP_OBJECT = '{"a":' * DEEP + "1" + "}" * DEEP
ROUTES = [
    "/v1/completions",
    "/v1/chat/completions",
    "/generate",
    "/tokenize",
    "/detokenize",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
]


@pytest.fixture(scope="module")
def client(tiny_engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("roots")
    with tiny_engine({}, max_total_tokens=1024) as engine:
        yield create_app(engine, ApiOptions(lora_roots=(str(root),))).test_client()


def _assert_too_deep(answer, what: str) -> None:
    assert answer.status_code == 400, answer.get_data()[:300]
    error = answer.get_json()["error"]
    assert error["type"] == "invalid_request_error"
    assert what in error["message"] and f"{MAX_JSON_DEPTH} levels" in error["message"]


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize(
    "body", [DEEP_BODY, ('{"prompt": ' + DEEP_OBJECT + "}").encode()], ids=["lists", "objects"]
)
def test_deep_body_is_a_400_on_every_route(client, path, body):
    _assert_too_deep(client.post(path, data=body, content_type="application/json"), "the body")


@pytest.mark.parametrize(
    "body, what",
    [
        ({"prompt": "hi", "guided_json": DEEP_OBJECT}, "'guided_json'"),
        ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": DEEP_OBJECT}}}, "'response_format.json_schema.schema'"),
    ],
    ids=["guided_json", "json_schema"],
)  # fmt: skip
def test_deep_json_text_in_a_field_is_a_400(client, body, what):
    _assert_too_deep(client.post("/v1/completions", json=body), what)


def test_deep_tool_arguments_are_a_400(client):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP_OBJECT}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    answer = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    _assert_too_deep(answer, "messages[1] tool call arguments")


def test_bodies_at_the_bound_are_parsed_and_the_server_keeps_serving(client):
    within = {"prompt": "hi", "max_tokens": 1, "logit_bias": {}, "user": None}
    nested = "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1)
    body = json.dumps(within)[:-1] + ', "stop": ' + nested + "}"
    answer = client.post("/v1/completions", data=body, content_type="application/json")
    assert answer.status_code == 400 and "levels" not in answer.get_json()["error"]["message"]
    answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert answer.status_code == 200


@pytest.mark.parametrize(
    "text, deep",
    [
        ("[" * (MAX_JSON_DEPTH + 1), True),  # unclosed: the parser will refuse it anyway
        ("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH, False),
        ('["' + "[" * 1000 + '"]', False),  # brackets inside a string do not nest
        ('["\\"' + "{" * 1000 + '"]', False),  # nor after an escaped quote
        ("[]" * 10_000, False),  # many brackets, shallow
        ('{"a": ' * (MAX_JSON_DEPTH + 1), True),
    ],
    ids=range(6),
)
def test_the_scan_counts_depth_outside_strings(text, deep):
    assert nests_too_deep(text) is deep
    assert nests_too_deep(text.encode()) is deep
