"""A tool's `parameters` placed inside the schema of a constrained call keep their meaning: the
`jsonschema` package (the oracle) gives every instance the same verdict under the parameters
alone and, as a call's `arguments`, under the combined schema (issue 67); and an object schema
that lists its keys takes no others once closed (`close_objects`, as vLLM's xgrammar reads it)."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel

from toppings.server.api.openai.tools import parse_tools
from toppings.server.sampling.schema_refs import (
    close_objects,
    rebase_refs,
    resolve_pointer,
    subschemas,
)


class City(BaseModel):
    name: str
    country: Literal["FR", "DE"]


class Trip(BaseModel):
    """What pydantic emits for nested models: `$defs` and `#/$defs/...` refs."""

    start: City
    stops: list[City]
    back: City | None = None


RECURSIVE = {  # a tree whose nodes refer to the parameters' root ("#")
    "type": "object",
    "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
    "required": ["v"],
    "additionalProperties": False,
}
DRAFT7 = {  # `definitions`, an escaped pointer, and a const whose data looks like a $ref
    "definitions": {"a/b": {"enum": ["x", "y"]}},
    "properties": {"k": {"$ref": "#/definitions/a~1b"}, "c": {"const": {"$ref": "#/nowhere"}}},
    "required": ["k"],
}
PARIS = {"name": "Paris", "country": "FR"}
INSTANCES = {
    "trip": [
        {"start": PARIS, "stops": []},
        {"start": PARIS, "stops": [PARIS, {"name": "Bonn", "country": "DE"}], "back": None},
        {"start": PARIS, "stops": [{"name": "Rome", "country": "IT"}]},
        {"start": {"name": "Paris"}, "stops": []},
        {"start": PARIS, "stops": [], "back": {"name": 3, "country": "FR"}},
        {"stops": []},
    ],
    "tree": [
        {"v": 1},
        {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]},
        {"v": 1, "kids": [{"v": 2, "kids": [{"w": 3}]}]},
        {"v": 1, "kids": [{"v": "2"}]},
    ],
    "draft7": [
        {"k": "x"},
        {"k": "z"},
        {"k": "y", "c": {"$ref": "#/nowhere"}},
        {"k": "y", "c": {"$ref": "#/$defs/tool_2/nowhere"}},
    ],
}


def _tools() -> list[dict]:
    params = {"trip": Trip.model_json_schema(), "tree": RECURSIVE, "draft7": DRAFT7}
    return [{"type": "function", "function": {"name": n, "parameters": p}}
            for n, p in params.items()]  # fmt: skip


def _valid(instance, schema) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("name", list(INSTANCES))
def test_a_calls_arguments_are_judged_as_under_the_parameters_alone(choice, name):
    tools = _tools()
    assert "$defs" in tools[0]["function"]["parameters"]  # pydantic's shape, as the issue had
    tool_choice = {"type": "function", "function": {"name": name}} if choice == "named" else choice
    combined = json.loads(parse_tools({"tools": tools, "tool_choice": tool_choice})
                          .constraint().spec)  # fmt: skip
    jsonschema.Draft202012Validator.check_schema(combined)
    params = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
    verdicts = [_valid(i, params) for i in INSTANCES[name]]
    assert True in verdicts and False in verdicts  # the instances tell the schemas apart
    calls = [{"name": name, "arguments": i} for i in INSTANCES[name]]
    assert [_valid(c, combined) for c in calls] == verdicts


def test_rebase_moves_only_local_pointers_in_schema_positions():
    schema = {
        "$ref": "#",
        "anyOf": [{"$ref": "#/$defs/A"}, {"$ref": "#anchor"}, {"$ref": "other.json#/x"}],
        "items": [{"$ref": "#/$defs/A"}],
        "default": {"$ref": "#/$defs/A"},
        "$defs": {"A": {"type": "string"}},
    }
    out = rebase_refs(schema, "/$defs/t")
    assert out["$ref"] == "#/$defs/t"
    assert [s["$ref"] for s in out["anyOf"]] == ["#/$defs/t/$defs/A", "#anchor", "other.json#/x"]
    assert out["items"] == [{"$ref": "#/$defs/t/$defs/A"}]
    assert out["default"] == {"$ref": "#/$defs/A"} and schema["$ref"] == "#"  # data; no change


def test_resolve_pointer_and_subschema_paths_agree():
    schema = {"properties": {"a/b": {"type": "string"}, "m~n": {"items": [{"const": 1}]}}}
    paths = dict(subschemas(schema))
    assert set(paths) == {"/properties/a~1b", "/properties/m~0n"}
    for path, sub in paths.items():
        assert resolve_pointer(schema, "#" + path) is sub
    assert resolve_pointer(schema, "#/properties/m~0n/items/0") == {"const": 1}
    assert resolve_pointer(schema, "#/properties/a%7E1b") == {"type": "string"}
    with pytest.raises(KeyError):
        resolve_pointer(schema, "#/properties/nope")


OPEN_PARAMS = {  # a function's parameters as clients write them: nothing said of other keys
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "stops": {"type": "array", "items": {"type": "object", "properties": {"n": {}}}},
    },
    "required": ["city"],
    "$defs": {"Unit": {"type": "object", "properties": {"u": {"enum": ["c", "f"]}}}},
}
KEPT_OPEN = [  # schemas close_objects leaves as they are: they take other keys on purpose
    {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
    {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
    {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": {"type": "integer"}},
    {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]},  # b: another key
    {"type": "object"},  # json_object: any object
    {"const": {"properties": {"a": {}}}},  # data, not a schema
]


def test_close_objects_refuses_only_unlisted_keys():
    """Under the closed schema (jsonschema the oracle) an instance is valid where it was and
    has no key its object does not list; every object schema that lists keys is closed."""
    closed = close_objects(OPEN_PARAMS)
    jsonschema.Draft202012Validator.check_schema(closed)
    unit = {"$ref": "#/$defs/Unit"}
    instances = [
        {"city": "Paris"}, {"city": "Paris", "stops": [{"n": 1}]}, {"city": 3},
        {"city": "Paris", "type": "object"}, {"city": "Paris", "stops": [{"n": 1, "m": 2}]},
    ]  # fmt: skip
    assert [_valid(i, OPEN_PARAMS) for i in instances] == [True, True, False, True, True]
    assert [_valid(i, closed) for i in instances] == [True, True, False, False, False]
    defs = {"$defs": closed["$defs"]}
    assert _valid({"u": "c"}, {**unit, **defs}) and not _valid({"u": "c", "v": 1}, {**unit, **defs})
    assert "additionalProperties" not in OPEN_PARAMS  # the input is not changed


@pytest.mark.parametrize("schema", KEPT_OPEN)
def test_close_objects_keeps_schemas_that_take_other_keys(schema):
    assert close_objects(schema) == schema


def test_close_objects_leaves_the_parts_of_a_combination_open():
    """allOf's parts each list some keys of one object: closing a part would refuse the others'
    (an instance valid before stays valid); what they hold is closed."""
    both = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "object", "properties": {"x": {}}}}},
            {"type": "object", "properties": {"b": {}}},
        ]
    }
    closed = close_objects(both)
    assert _valid({"a": {"x": 1}, "b": 2}, closed)
    assert _valid({"a": {"x": 1, "y": 2}}, both) and not _valid({"a": {"x": 1, "y": 2}}, closed)
