"""`has_finite_instance` against the `jsonschema` package (the oracle): a schema is judged to
allow a finite value exactly when one of a few thousand small JSON values validates under it
(issue 67: a schema whose every value nests without end ran to `max_tokens`)."""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest

from toppings.server.sampling.schema_finite import has_finite_instance

KEYS = ("a", "b", "next", "kids")
NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}, "required": ["next"]}
NO_FINITE_VALUE = {
    "required self": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    "non-empty list of itself": {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    "pydantic-style $defs": {"$defs": {"Node": NODE}, "$ref": "#/$defs/Node"},
    "mutual": {
        "$defs": {
            "A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}, "required": ["b"]},
            "B": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]},
        },
        "$ref": "#/$defs/A",
    },
    "anyOf of two cycles": {"anyOf": [
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        {"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1},
    ]},
    "draft-7 items list": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
                           "items": [{"$ref": "#"}], "minItems": 1},
    "required, unlisted": {"type": "object", "required": ["a"], "additionalProperties": {
        "$ref": "#"}},
    "false property": {"type": "object", "properties": {"a": False}, "required": ["a"]},
    "contains itself": {"type": "array", "contains": {"$ref": "#"}},
    "allOf with a cycle": {"allOf": [{"type": "object"}, {"$ref": "#/$defs/Node"}],
                           "$defs": {"Node": NODE}},
}  # fmt: skip
SOME_FINITE_VALUE = {
    "the issue's, untyped": {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    "nullable link": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"},
                      {"type": "null"}]}}, "required": ["next"]},
    "optional link": {"type": "object", "properties": {"next": {"$ref": "#"}}},
    "tree": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
             "required": ["kids"]},
    "prefix then itself": {"type": "array", "prefixItems": [{"type": "integer"}],
                           "items": {"$ref": "#"}, "minItems": 1},
    "array or leaf": {"type": ["array", "string"], "items": {"$ref": "#"}, "minItems": 1},
    "cycle with an exit": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "object", "properties":
                           {"b": {"const": 1}}, "required": ["b"]}], "$defs": {"Node": NODE}},
    "enum on an untyped cycle": {"properties": {"a": {"$ref": "#"}}, "required": ["a"],
                                 "enum": [{"a": 1}, 1]},
    "minContains 0": {"type": "array", "contains": {"$ref": "#"}, "minContains": 0},
}  # fmt: skip


def _values(depth: int) -> list:
    """Small JSON values: scalars, then arrays of 0-2 and objects of 0-2 of KEYS, nested."""
    level = [None, True, 1, "x"]
    values = list(level)
    for _ in range(depth):
        deeper = [[], {}]
        for v in level:
            deeper += [[v], [1, v], *({k: v} for k in KEYS)]
            deeper += [{k: v, j: v} for k, j in itertools.combinations(KEYS, 2)]
        values += deeper
        level = deeper
    return values


VALUES = _values(3)


@pytest.mark.parametrize(
    "schema, expected",
    [(s, False) for s in NO_FINITE_VALUE.values()]
    + [(s, True) for s in SOME_FINITE_VALUE.values()],
    ids=[*NO_FINITE_VALUE, *SOME_FINITE_VALUE],
)
def test_a_finite_value_exists_exactly_where_the_oracle_finds_one(schema, expected):
    validator = jsonschema.validators.validator_for(schema)(schema)
    assert any(validator.is_valid(v) for v in VALUES) == expected
    assert has_finite_instance(json.dumps(schema)) == expected


def test_schemas_it_does_not_model_are_taken_as_satisfiable():
    nested_id = {"$defs": {"N": {"$id": "urn:n", "type": "object", "properties": {"a": {
        "$ref": "#"}}, "required": ["a"]}}, "$ref": "#/$defs/N"}  # fmt: skip
    assert has_finite_instance(json.dumps(nested_id))
    assert has_finite_instance(json.dumps({"$ref": "#/nowhere"}))
    assert has_finite_instance("true") and not has_finite_instance("false")
