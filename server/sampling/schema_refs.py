"""A JSON schema's subschemas and its local `$ref`s: found, resolved, and moved under a prefix;
and its objects closed to the keys they list.

A `$ref` of "#" or "#/a/b" is a JSON pointer into the document it sits in (RFC 6901, with
`~0`/`~1` escapes, percent-encoded as a URI fragment). A schema placed inside a bigger one (a
tool's `parameters` inside the call a "required" tool choice constrains) keeps its meaning only
when each such pointer is given the path it was moved to: `rebase_refs` does that. Only the
keywords that hold schemas are walked (`SCHEMA_KEYWORDS`, as the JSON Schema drafts 4 to 2020-12
define them), never a value keyword (`const`, `enum`, `default`, `examples`), whose objects are
data, not schemas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote

# keyword -> how it holds subschemas: one schema, a list of them, or a map of names to them.
ONE, LIST, MAP = "one", "list", "map"
SCHEMA_KEYWORDS = {
    "additionalProperties": ONE, "additionalItems": ONE, "contains": ONE, "propertyNames": ONE,
    "not": ONE, "if": ONE, "then": ONE, "else": ONE, "unevaluatedItems": ONE,
    "unevaluatedProperties": ONE, "contentSchema": ONE,
    "allOf": LIST, "anyOf": LIST, "oneOf": LIST, "prefixItems": LIST,
    "properties": MAP, "patternProperties": MAP, "$defs": MAP, "definitions": MAP,
    "dependentSchemas": MAP, "dependencies": MAP,
}  # fmt: skip


def subschemas(schema: Any) -> Iterator[tuple[str, Any]]:
    """Each direct subschema of `schema` with its JSON pointer path from `schema` ("/items",
    "/properties/city", ...). `items` is one schema or (drafts before 2020-12) a list; a
    `dependencies` entry that is a list of names is not a schema."""
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        how = _holds(key, value)
        if how == ONE:
            yield f"/{_escape(key)}", value
        elif how == LIST and isinstance(value, list):
            for idx, sub in enumerate(value):
                yield f"/{_escape(key)}/{idx}", sub
        elif how == MAP and isinstance(value, dict):
            for name, sub in value.items():
                if isinstance(sub, (dict, bool)):
                    yield f"/{_escape(key)}/{_escape(name)}", sub


def is_local_pointer(ref: Any) -> bool:
    """Whether `ref` is a JSON pointer into its own document ("#" or "#/..."); "#name" (an
    `$anchor`) and other documents are not."""
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))


def resolve_pointer(document: Any, ref: str) -> Any:
    """The value a local `$ref` points to in `document`; raises KeyError when there is none."""
    node = document
    for raw in unquote(ref[1:]).split("/")[1:]:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise KeyError(ref)
    return node


def rebase_refs(schema: Any, prefix: str) -> Any:
    """A copy of `schema` with each local pointer `$ref` moved under `prefix` (a JSON pointer
    path such as "/$defs/tool_0"): the schema keeps its meaning once placed at that path of
    another document. Anchors and other documents' refs are kept as they are."""
    if not isinstance(schema, dict):
        return schema
    out = _mapped(schema, lambda _, sub: rebase_refs(sub, prefix))
    ref = schema.get("$ref")
    if is_local_pointer(ref):
        out["$ref"] = "#" + prefix + ref[1:]
    return out


# Keywords whose direct subschemas combine with others on one instance: closing one of them to
# its own keys would refuse the keys its siblings add (allOf's parts, a conditional's branches).
COMBINING = frozenset({"allOf", "not", "if", "then", "else", "dependentSchemas", "dependencies"})
OPENING = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def close_objects(schema: Any, closable: bool = True) -> Any:
    """A copy of `schema` in which each object schema that lists `properties` and says nothing
    of other keys (no `additionalProperties`, `patternProperties`, `unevaluatedProperties`)
    takes no others, as vLLM's default grammar backend (xgrammar) reads such a schema: a
    function's `parameters` are written so, and a model left free to add keys adds them until
    `max_tokens`. Not closed: a schema whose `required` names a key it does not list, and the
    direct parts of a combination (`COMBINING`), whose siblings may list the other keys."""
    if not isinstance(schema, dict):
        return schema
    out = _mapped(schema, lambda key, sub: close_objects(sub, key not in COMBINING))
    props, required = schema.get("properties"), schema.get("required")
    if (
        closable
        and isinstance(props, dict)
        and not any(key in schema for key in OPENING)
        and (not isinstance(required, list) or all(r in props for r in required))
    ):
        out["additionalProperties"] = False
    return out


def _mapped(schema: dict, fn: Callable[[str, Any], Any]) -> dict:
    """A copy of `schema` whose direct subschemas are `fn(keyword, subschema)`."""
    out = dict(schema)
    for key, value in schema.items():
        how = _holds(key, value)
        if how == ONE:
            out[key] = fn(key, value)
        elif how == LIST and isinstance(value, list):
            out[key] = [fn(key, sub) for sub in value]
        elif how == MAP and isinstance(value, dict):
            out[key] = {name: fn(key, sub) for name, sub in value.items()}
    return out


def _holds(key: str, value: Any) -> str | None:
    """How keyword `key` holds subschemas (None: it holds none)."""
    if key == "items":
        return LIST if isinstance(value, list) else ONE
    return SCHEMA_KEYWORDS.get(key)


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
