"""The structured-output fields of a request body -> one `Constraint` (or None: free text).

OpenAI's `response_format`: `{"type": "text"}` (free), `{"type": "json_object"}` (any JSON
object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`. vLLM's extra
body fields: `guided_json` (a schema, as an object or JSON text), `guided_regex`,
`guided_choice` (a list of strings), `guided_grammar` (GBNF/EBNF or Lark). At most one of them
may constrain a request. vLLM's options that would change how a constraint is applied
(`guided_decoding_backend`, `guided_whitespace_pattern`, ...) are refused by name: the server
does not honour them. Whether the spec compiles is checked by the engine before queueing
(server/sampling/grammar.py).
"""

from __future__ import annotations

import json
from typing import Any

from toppings.server.requests.errors import nests_too_deep, too_deep
from toppings.server.requests.request import Constraint, ConstraintKind, RequestError

ANY_JSON_OBJECT = '{"type": "object"}'
GUIDED_FIELDS = {
    "guided_json": ConstraintKind.JSON_SCHEMA,
    "guided_regex": ConstraintKind.REGEX,
    "guided_choice": ConstraintKind.CHOICE,
    "guided_grammar": ConstraintKind.GRAMMAR,
}
# vLLM's fields about how to constrain, which this server does not honour.
REFUSED_FIELDS = (
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "structured_outputs",
    "guided_options_request",
)


def _schema_text(value: Any, key: str) -> str:
    """A JSON schema given as an object (or JSON text of one) as JSON text."""
    if isinstance(value, str):
        if nests_too_deep(value):
            raise RequestError(too_deep(f"'{key}'"))
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RequestError(f"'{key}' is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise RequestError(f"'{key}' must be a JSON schema object")
    return json.dumps(value)


def _response_format(value: Any) -> Constraint | None:
    if not isinstance(value, dict):
        raise RequestError("'response_format' must be an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(ConstraintKind.JSON_SCHEMA, ANY_JSON_OBJECT, "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise RequestError("'response_format.json_schema' must be an object")
        schema = spec.get("schema")
        if schema is None:  # OpenAI: without a schema the model may write any JSON
            return Constraint(ConstraintKind.JSON_SCHEMA, "{}", "response_format")
        key = "response_format.json_schema.schema"
        return Constraint(ConstraintKind.JSON_SCHEMA, _schema_text(schema, key), key)
    raise RequestError(
        f"'response_format.type' must be 'text', 'json_object' or 'json_schema', not {kind!r}"
    )


def _guided(key: str, value: Any) -> Constraint:
    kind = GUIDED_FIELDS[key]
    if kind is ConstraintKind.JSON_SCHEMA:
        return Constraint(kind, _schema_text(value, key), key)
    if kind is ConstraintKind.CHOICE:
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise RequestError(f"'{key}' must be a non-empty list of strings")
        if any(not c for c in value):
            raise RequestError(f"'{key}' must not hold an empty string")
        return Constraint(kind, json.dumps(value), key)
    if not isinstance(value, str) or not value:
        raise RequestError(f"'{key}' must be a non-empty string")
    return Constraint(kind, value, key)


def parse_constraint(body: dict) -> Constraint | None:
    """The one constraint of a body's structured-output fields; raises RequestError for a
    malformed field, for two constraining fields, and for a vLLM option not honoured here."""
    for key in REFUSED_FIELDS:
        if body.get(key) is not None:
            raise RequestError(f"'{key}' is not supported by this server")
    found: list[tuple[str, Constraint]] = []
    if body.get("response_format") is not None:
        constraint = _response_format(body["response_format"])
        if constraint is not None:
            found.append(("response_format", constraint))
    for key in GUIDED_FIELDS:
        if body.get(key) is not None:
            found.append((key, _guided(key, body[key])))
    if len(found) > 1:
        names = ", ".join(f"'{key}'" for key, _ in found)
        raise RequestError(f"give at most one structured-output field, not {names}")
    return found[0][1] if found else None
