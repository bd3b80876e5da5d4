"""JSON nested past the server's bound (issue 48): every JSON route, and JSON text inside a
field (a guided_json string, a tool call's arguments), answers 400 naming the limit, found by a
scan before parsing; the server keeps serving. The scan is linear (issue 67: a regex in it was
quadratic on an unterminated string of escaped quotes and froze the process): it agrees with a
byte-by-byte state machine and with the parser's own nesting on random text, across chunks."""

from __future__ import annotations

import json
import random

import pytest

from tests.server.api.conftest import JSON_ROUTES
from toppings.server.requests import json_depth
from toppings.server.requests.errors import MAX_JSON_DEPTH, nests_too_deep

DEEP = 100_000
DEEP_BODY = b"[" * DEEP + b"]" * DEEP
DEEP_OBJECT = '{"a":' * DEEP + "1" + "}" * DEEP


def _assert_too_deep(answer, what: str) -> None:
    assert answer.status_code == 400, answer.get_data()[:300]
    error = answer.get_json()["error"]
    assert error["type"] == "invalid_request_error"
    assert what in error["message"] and f"{MAX_JSON_DEPTH} levels" in error["message"]


@pytest.mark.parametrize("path", JSON_ROUTES)
@pytest.mark.parametrize(
    "body", [DEEP_BODY, ('{"prompt": ' + DEEP_OBJECT + "}").encode()], ids=["lists", "objects"]
)
def test_deep_body_is_a_400_on_every_route(api_client, path, body):
    _assert_too_deep(api_client.post(path, data=body, content_type="application/json"), "the body")


@pytest.mark.parametrize(
    "body, what",
    [
        ({"prompt": "hi", "guided_json": DEEP_OBJECT}, "'guided_json'"),
        ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": DEEP_OBJECT}}}, "'response_format.json_schema.schema'"),
    ],
    ids=["guided_json", "json_schema"],
)  # fmt: skip
def test_deep_json_text_in_a_field_is_a_400(api_client, body, what):
    _assert_too_deep(api_client.post("/v1/completions", json=body), what)


def test_deep_tool_arguments_are_a_400(api_client):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP_OBJECT}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    answer = api_client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    _assert_too_deep(answer, "messages[1] tool call arguments")


def test_bodies_at_the_bound_are_parsed_and_the_server_keeps_serving(api_client):
    within = {"prompt": "hi", "max_tokens": 1, "logit_bias": {}, "user": None}
    nested = "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1)
    body = json.dumps(within)[:-1] + ', "stop": ' + nested + "}"
    answer = api_client.post("/v1/completions", data=body, content_type="application/json")
    assert answer.status_code == 400 and "levels" not in answer.get_json()["error"]["message"]
    answer = api_client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
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


def _hostile(size: int, prefix: bytes = b'{"prompt": [') -> bytes:
    """The body of issue 67's probe: brackets past the bound, then an unterminated string of
    escaped quotes up to `size` bytes."""
    head = prefix + b"[" * 130 + b'"'
    return head + b'\\"' * ((size - len(head)) // 2)


def test_the_hostile_body_at_the_largest_size_is_a_400(api_client):
    size = api_client.application.config["MAX_CONTENT_LENGTH"]
    body = _hostile(size - 1)
    assert len(body) < size
    answer = api_client.post("/v1/completions", data=body, content_type="application/json")
    _assert_too_deep(answer, "the body")
    assert api_client.get("/health").status_code == 200


def test_escaped_quotes_without_deep_brackets_are_parsed_as_strings():
    # the same unterminated run, shallow: not deep (the parser then refuses it as bad JSON)
    assert not nests_too_deep(b'{"prompt": [' + b"[]" * 200 + b'"' + b'\\"' * 50_000)
    assert not nests_too_deep(b'["' + b'\\"' * 100_000 + b"[" * 200 + b'"]')


def _reference_depth(raw: bytes) -> int:
    """The deepest bracket outside strings, by the byte-at-a-time state machine the scan
    evaluates: a quote after an even run of backslashes opens or closes a string."""
    depth = deepest = backslashes = 0
    in_string = False
    for byte in raw:
        if byte == ord("\\"):
            backslashes += 1
            continue
        if byte == ord('"') and backslashes % 2 == 0:
            in_string = not in_string
        elif not in_string and byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif not in_string and byte in b"]}":
            depth -= 1
        backslashes = 0
    return deepest


def _nesting(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_nesting, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_nesting, value.values()), default=0)
    return 0


def _random_json(rng: random.Random, depth: int):
    if depth == 0 or rng.random() < 0.2:
        return rng.choice(["a\\", 'q"[', "{]", '\\\\"', "", 1, None, "\\\\"])
    if rng.random() < 0.5:
        return [_random_json(rng, depth - 1) for _ in range(rng.randrange(1, 3))]
    return {f'k{i}\\"[': _random_json(rng, depth - 1) for i in range(rng.randrange(1, 3))}


@pytest.mark.parametrize("chunk_bytes", [1, 3, 7, json_depth.CHUNK_BYTES])
def test_the_scan_agrees_with_the_parser_and_a_state_machine_across_chunks(
    monkeypatch, chunk_bytes
):
    monkeypatch.setattr(json_depth, "CHUNK_BYTES", chunk_bytes)
    rng = random.Random(chunk_bytes)
    for _ in range(200):
        value = _random_json(rng, rng.randrange(1, 9))
        text = json.dumps(value)
        bound = rng.randrange(0, 9)
        assert nests_too_deep(text, max_depth=bound) is (_nesting(value) > bound), text
    alphabet = b'[]{}"\\ab'
    for _ in range(300):
        raw = bytes(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        bound = rng.randrange(0, 6)
        assert nests_too_deep(raw, max_depth=bound) is (_reference_depth(raw) > bound), raw
