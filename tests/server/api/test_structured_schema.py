"""The structured-output fields of a body -> one Constraint, or a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from toppings.server.api.openai.schema import parse_chat, parse_completion, parse_native
from toppings.server.requests.request import ConstraintKind, RequestError

BASE = "base"
CHAT = {"model": BASE, "messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def constraint_of(body: dict, parse=parse_chat):
    return parse(body, BASE).sampling.get("constraint")


@pytest.mark.parametrize(
    "fields, kind, spec",
    [
        ({"response_format": {"type": "json_object"}}, ConstraintKind.JSON_SCHEMA,
         {"type": "object"}),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
         ConstraintKind.JSON_SCHEMA, SCHEMA),
        ({"guided_json": SCHEMA}, ConstraintKind.JSON_SCHEMA, SCHEMA),
        ({"guided_json": json.dumps(SCHEMA)}, ConstraintKind.JSON_SCHEMA, SCHEMA),
        ({"guided_choice": ["yes", "no"]}, ConstraintKind.CHOICE, ["yes", "no"]),
    ],
)  # fmt: skip
def test_json_fields(fields, kind, spec):
    c = constraint_of(dict(CHAT, **fields))
    assert c.kind is kind and json.loads(c.spec) == spec


def test_text_fields_on_every_endpoint():
    c = constraint_of({"prompt": "x", "guided_regex": "[a-z]+"}, parse_completion)
    assert (c.kind, c.spec) == (ConstraintKind.REGEX, "[a-z]+")
    c = constraint_of({"prompt": "x", "guided_grammar": 'root ::= "a"'}, parse_native)
    assert (c.kind, c.spec) == (ConstraintKind.GRAMMAR, 'root ::= "a"')
    assert constraint_of(dict(CHAT, response_format={"type": "text"})) is None
    assert constraint_of(CHAT) is None


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": [1]}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "'guided_regex', 'guided_choice'"),
        ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "response_format"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"guided_grammar": "x" * 100_001}, "at most 100000"),
        ({"tool_choice": "required"}, "tools"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_refused_with_the_field_named(fields, named):
    with pytest.raises(RequestError) as err:
        parse_chat(dict(CHAT, **fields), BASE)
    assert err.value.code == 400 and named in str(err.value)
