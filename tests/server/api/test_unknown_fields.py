"""A request field the server does not honour is a 400 naming it, never silently ignored
(issue 32): per endpoint, nested options and chat messages included; null counts as absent."""

from __future__ import annotations

import pytest

from toppings.server.api.schema import parse_chat, parse_completion, parse_native
from toppings.server.requests.request import RequestError

BASE = "tiny-llama"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "parse, body, field, where",
    [
        (parse_completion, {"prompt": "a", "guided_jsn": {}}, "guided_jsn", "/v1/completions"),
        (parse_completion, {"prompt": "a", "max_new_tokens": 4}, "max_new_tokens",
         "/v1/completions"),
        (parse_completion, {"prompt": "a", "messages": CHAT}, "messages", "/v1/completions"),
        (parse_chat, {"messages": CHAT, "prompt": "a"}, "prompt", "/v1/chat/completions"),
        (parse_chat, {"messages": CHAT, "skip_special_tokens": False}, "skip_special_tokens",
         "/v1/chat/completions"),
        (parse_chat, {"messages": CHAT, "chat_template_kwargs": {"x": 1}},
         "chat_template_kwargs", "/v1/chat/completions"),
        (parse_native, {"prompt": "a", "max_tokens": 4}, "max_tokens", "/generate"),
        (parse_native, {"prompt": "a", "model": "sql"}, "model", "/generate"),
        (parse_completion, {"prompt": "a", "stream": True, "stream_options": {"usage": True}},
         "usage", "'stream_options'"),
        (parse_chat, {"messages": [{"role": "user", "content": "hi", "images": ["x"]}]},
         "images", r"messages\[0\]"),
    ],
)  # fmt: skip
def test_unknown_field_is_refused_by_name(parse, body, field, where):
    with pytest.raises(RequestError, match=f"'{field}' is not a field .* {where}") as info:
        parse(body, BASE)
    assert info.value.code == 400


def test_null_fields_count_as_absent():
    # What a client that sends every field of its model (unset ones as null) writes.
    parse_chat({"messages": [CHAT[0] | {"refusal": None, "audio": None}], "foo": None}, BASE)
    parse_completion({"prompt": "a", "anything": None}, BASE)
    parse_native({"prompt": "a", "max_tokens": None}, BASE)


def test_openai_metadata_and_neutral_values_are_accepted():
    body = {"messages": CHAT, "user": "tenant-7", "store": False, "parallel_tool_calls": True}
    assert parse_chat(body, BASE).messages == CHAT
    parse_completion({"prompt": "a", "user": "tenant-7", "store": False}, BASE)
    for body, field in (
        ({"messages": CHAT, "store": True}, "store"),
        ({"messages": CHAT, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ):
        with pytest.raises(RequestError, match=f"'{field}' is not supported"):
            parse_chat(body, BASE)  # fmt: skip


def test_message_name_reaches_the_template():
    messages = [{"role": "user", "content": "hi", "name": "ana"}]
    assert parse_chat({"messages": messages}, BASE).messages == messages
    with pytest.raises(RequestError, match="'name' must be a string"):
        parse_chat({"messages": [{"role": "user", "content": "hi", "name": 3}]}, BASE)
