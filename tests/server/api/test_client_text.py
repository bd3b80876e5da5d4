"""A lone UTF-16 surrogate escape (`"\\ud800"` without its pair) is valid JSON but no character:
before the body check it reached the tokenizer and answered 500. Every route answers 400 naming
the field that holds it (a value or a key, however deep); a surrogate pair and a literal
backslash-u are text like any other, and the server keeps serving. A name nobody serves is repeated
in its 404 cut to 64 characters."""

from __future__ import annotations

import pytest

from tests.server.api.conftest import JSON_ROUTES
from toppings.server.requests.errors import parse_json_object


def _refused(answer, field: str) -> None:
    assert answer.status_code == 400, answer.get_data()[:300]
    error = answer.get_json()["error"]
    assert error["type"] == "invalid_request_error"
    assert field in error["message"] and "surrogate" in error["message"], error["message"]


@pytest.mark.parametrize("path", JSON_ROUTES)
def test_a_lone_surrogate_is_a_400_on_every_route(api_client, path):
    body = b'{"prompt": "a\\ud800b", "max_tokens": 2}'
    _refused(api_client.post(path, data=body, content_type="application/json"), "'prompt'")


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "x"}, {"role": "user", '
         b'"content": [{"type": "text", "text": "\\uDFFF"}]}], "max_tokens": 2}',
         "'messages[1].content[0].text'"),
        ("/v1/completions", b'{"prompt": "hi", "stop": ["ok", "\\udc80"], "max_tokens": 2}',
         "'stop[1]'"),
        ("/v1/completions", b'{"model": "\\ud801", "prompt": "hi", "max_tokens": 2}', "'model'"),
        ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"\\ud800": 1}, "max_tokens": 2}',
         "a key of 'logit_bias'"),
        ("/v1/completions", b'{"\\udbff": 1, "prompt": "hi"}', "a key of the body"),
    ],
    ids=["chat part", "stop", "model", "nested key", "top key"],
)  # fmt: skip
def test_the_message_names_the_field(api_client, path, body, field):
    _refused(api_client.post(path, data=body, content_type="application/json"), field)


def test_pairs_and_escaped_backslashes_are_text_and_the_server_keeps_serving(api_client):
    for prompt in (b'"\\ud83d\\ude00 hi"', b'"\\\\ud800 hi"'):
        body = b'{"prompt": ' + prompt + b', "max_tokens": 2}'
        answer = api_client.post("/v1/completions", data=body, content_type="application/json")
        assert answer.status_code == 200, answer.get_data()[:300]
        assert answer.get_json()["usage"]["completion_tokens"] == 2


def test_the_parse_keeps_what_it_checked():
    assert parse_json_object(b'{"a": ["\\ud83d\\ude00", {"b": "\\\\udc00"}]}') == {
        "a": ["\N{GRINNING FACE}", {"b": "\\udc00"}]
    }
    with pytest.raises(ValueError, match=r"'a\[1\]\.b' holds a lone"):
        parse_json_object(b'{"a": ["x", {"b": "\\udc00"}]}')


def test_an_unknown_name_is_cut_in_its_404(api_client):
    answer = api_client.post("/v1/completions", json={"model": "x" * 5000, "prompt": "hi"})
    assert answer.status_code == 404
    message = answer.get_json()["error"]["message"]
    assert message == f"adapter {'x' * 64!r}... (5000 characters) does not exist"
