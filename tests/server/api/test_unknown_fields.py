"""A request field the server does not honour is a 400 naming it, never silently ignored
(issue 32): per endpoint, nested options and chat messages included; null counts as absent."""

from __future__ import annotations

import pytest

from toppings.server.api.openai.schema import parse_chat, parse_completion, parse_native
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
        (parse_completion, {"prompt": "a", "chat_template_kwargs": {"x": 1}},
         "chat_template_kwargs", "/v1/completions"),
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


@pytest.mark.parametrize(
    "field, value",
    [
        ("metadata", {"session": "a7", "team": "search"}),
        ("service_tier", "auto"),
        ("store", True),
        ("store", False),
        ("user", "tenant-7"),
        ("parallel_tool_calls", False),
        ("parallel_tool_calls", True),
        ("reasoning_effort", "low"),
        ("modalities", ["text"]),
        ("spaces_between_special_tokens", False),
    ],
)
def test_metadata_class_fields_are_accepted_and_named(field, value):
    """OpenAI's fields that change nothing here: accepted, and named for the response header."""
    chat = parse_chat({"messages": CHAT, field: value}, BASE)
    assert chat.messages == CHAT and chat.ignored == (field,)
    assert parse_completion({"prompt": "a", field: value}, BASE).ignored == (field,)


def test_ignored_fields_are_named_in_order_and_null_is_absent():
    body = {"messages": CHAT, "user": "u", "metadata": {"k": "v"}, "store": None}
    assert parse_chat(body, BASE).ignored == ("metadata", "user")
    assert parse_chat({"messages": CHAT}, BASE).ignored == ()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("metadata", "tag", "'metadata' must be an object"),
        ("metadata", {"k": 3}, "'metadata' must hold at most 16 string values"),
        ("metadata", {str(i): "v" for i in range(17)}, "at most 16"),
        ("service_tier", 1, "'service_tier' must be a string"),
        ("store", "yes", "'store' must be a boolean"),
        ("user", 7, "'user' must be a string"),
        ("parallel_tool_calls", 0, "'parallel_tool_calls' must be a boolean"),
        ("reasoning_effort", "extreme", "'reasoning_effort' must be one of"),
        ("modalities", ["text", "audio"], "'modalities' other than"),
        ("modalities", "text", "'modalities' must be an array"),
    ],
)
def test_metadata_class_fields_of_the_wrong_kind_are_refused(field, value, message):
    with pytest.raises(RequestError, match=message) as info:
        parse_chat({"messages": CHAT, field: value}, BASE)
    assert info.value.code == 400


@pytest.mark.parametrize("typo", ["metdata", "service-tier", "min-p", "reasoning", "usr"])
def test_typos_of_accepted_fields_are_still_refused(typo):
    with pytest.raises(RequestError, match=f"'{typo}' is not a field"):
        parse_chat({"messages": CHAT, typo: "x"}, BASE)


def test_fields_we_cannot_honour_are_refused_by_name():
    for body, field in (
        ({"messages": CHAT, "best_of": 3}, "best_of"),
        ({"prompt": "a", "suffix": "end"}, "suffix"),
        ({"messages": CHAT, "functions": [{"name": "f"}]}, "functions"),
    ):
        parse = parse_chat if "messages" in body else parse_completion
        with pytest.raises(RequestError, match=f"'{field}' is not supported"):
            parse(body, BASE)


def test_stream_options_need_stream_true():
    """As OpenAI: stream_options without `stream: true` is a 400, not silently unused."""
    for stream in ({}, {"stream": False}):
        for parse, body in ((parse_chat, {"messages": CHAT}), (parse_completion, {"prompt": "a"})):
            with pytest.raises(RequestError, match="'stream_options' is only allowed with"):
                parse(body | stream | {"stream_options": {"include_usage": True}}, BASE)
    assert parse_chat({"messages": CHAT, "stream": True,
                       "stream_options": {"include_usage": True}}, BASE).include_usage  # fmt: skip


def test_a_huge_unknown_field_name_gives_a_short_error():
    name = "x" * 1_000_000
    for parse, body in ((parse_chat, {"messages": CHAT}), (parse_native, {"prompt": "a"})):
        with pytest.raises(RequestError) as info:
            parse(body | {name: 1}, BASE)
        assert len(str(info.value)) < 200 and "1000000 characters" in str(info.value)
    with pytest.raises(RequestError) as info:
        parse_chat({"messages": [CHAT[0] | {name: 1}]}, BASE)
    assert len(str(info.value)) < 200
    with pytest.raises(RequestError) as info:
        parse_completion({"prompt": "a", "logit_bias": {name: 1}}, BASE)
    assert len(str(info.value)) < 200


def test_message_name_reaches_the_template():
    messages = [{"role": "user", "content": "hi", "name": "ana"}]
    assert parse_chat({"messages": messages}, BASE).messages == messages
    with pytest.raises(RequestError, match="'name' must be a string"):
        parse_chat({"messages": [{"role": "user", "content": "hi", "name": 3}]}, BASE)
