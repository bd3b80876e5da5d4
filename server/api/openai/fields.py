"""Fields of a client's JSON body: typed reads, token-id lists, `logit_bias`, and refusals of
unknown ones (server.api.openai's parsers share them; the names errors echo are cut by
server.requests.errors' `shown`)."""

from __future__ import annotations

from typing import Any

from toppings.server.requests.errors import shown
from toppings.server.requests.request import RequestError


def typed_field(body: dict, key: str, kind: str, default: Any = None) -> Any:
    """body[key] checked against `kind` ("int", "number", "bool", "str"); None means absent."""
    value = body.get(key)
    if value is None:
        return default
    is_bool = isinstance(value, bool)
    ok = {
        "int": isinstance(value, int) and not is_bool,
        "number": isinstance(value, (int, float)) and not is_bool,
        "bool": is_bool,
        "str": isinstance(value, str),
    }[kind]
    if not ok:
        noun = {"int": "an integer", "number": "a number", "bool": "a boolean", "str": "a string"}
        raise RequestError(f"'{key}' must be {noun[kind]}, not {json_type(value)}")
    return float(value) if kind == "number" else value


def check_known_fields(body: dict, known: frozenset[str] | set[str], where: str) -> None:
    """Refuse the first field of `body` outside `known` (a field set to null counts as absent,
    as OpenAI's own clients send unset fields)."""
    for key in body:
        if key not in known and body[key] is not None:
            raise RequestError(f"'{shown(key)}' is not a field this server accepts in {where}")


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if value is None:
        return "null"
    for py, name in ((bool, "boolean"), ((int, float), "number"), (str, "string"), (list, "array")):
        if isinstance(value, py):
            return name
    return "object"


def token_id_set(body: dict, key: str) -> frozenset[int]:
    """vLLM's `stop_token_ids` or `allowed_token_ids` (a list of token ids; absent: none);
    checked against the vocabulary when the request is built."""
    value = body.get(key)
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise RequestError(f"'{key}' must be a list of token ids (integers >= 0)")
    if not value:
        raise RequestError(f"'{key}' must hold at least one token id when given")
    return frozenset(value)


def logit_bias_pairs(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` as sorted (id, bias) pairs; ids are checked against the
    vocabulary when the request is built."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise RequestError(f"'logit_bias' must be an object, not {json_type(value)}")
    pairs = []
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise RequestError(f"'logit_bias' keys must be token ids, not {shown(key)!r}") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise RequestError(f"'logit_bias' values must be numbers, not {json_type(bias)}")
        pairs.append((token, float(bias)))
    return tuple(sorted(pairs))
