"""The HTTP error contract shared by the inference server and the cluster scheduler.

Every error of either process is answered as `{"error": {"message", "type", "code"}}` with HTTP
status `code`; a client mistake is a 4xx and the process keeps serving. This module is the
contract itself, so it imports nothing from toppings but its sibling json_depth (the bound on
client JSON, alike free of toppings imports): the scheduler, which knows servers only through
HTTP, imports this module (with stats_schema and server.http's front, waitress server and drain)
and nothing else of the server package.

The messages a client can get from both processes for the same input (a body that is not JSON,
an unknown model) are made here, so that they read the same whichever process answers, and both
Flask apps install their error handlers with `install_error_handlers`.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import re
import uuid
from typing import TYPE_CHECKING, Any, Protocol

from toppings.server.requests.json_depth import MAX_JSON_DEPTH, nests_too_deep

if TYPE_CHECKING:
    from flask import Flask, Response

# Error types (the "type" field), OpenAI's names where OpenAI has one.
INVALID_REQUEST = "invalid_request_error"  # 400: the client's body or parameters
AUTHENTICATION = "authentication_error"  # 401
PERMISSION_DENIED = "permission_denied"  # 403
NOT_FOUND = "not_found"  # 404: an unknown adapter, model, path or resource
CONFLICT = "conflict"  # 409
REQUEST_TIMEOUT = "request_timeout"  # 408: a request's body did not arrive in time
TOO_MANY_REQUESTS = "too_many_requests"  # 429: as many requests in flight as the limit allows
INSUFFICIENT_STORAGE = "insufficient_storage"  # 507: the adapter cache is full
UNAVAILABLE = "unavailable"  # 503: draining, shutting down, or no server ready yet
NO_SERVER_AVAILABLE = "no_server_available"  # 503: the scheduler has no server for the model
BAD_GATEWAY = "bad_gateway"  # 502: the scheduler got no answer from any server
SERVER_ERROR = "server_error"  # 500: a bug or an engine failure
# 422: the request's structured-output constraint failed while generating (the grammar engine
# found no way on, or went past its limits): the output so far does not satisfy it
CONSTRAINT_FAILED = "constraint_failed"

NO_SERVER_READY = "no server ready yet"
# Adapter names, on servers and in the scheduler's registry: letters, digits and a few
# separators (an org/name form included).
ADAPTER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")
ADAPTER_NAME_RULE = (
    "1-128 characters: letters, digits and . _ : / @ + - (starting with a letter or digit)"
)
MAX_NAME_SHOWN = 64  # characters of a client's name an error message repeats
RETRY_AFTER_S = 1  # the Retry-After of a 503 answered before any server is ready, and of a 429


API_KEY_REQUIRED = "a valid API key is required (Authorization: Bearer KEY)"


def bearer_header(key: str | None) -> dict[str, str]:
    """The `Authorization` header that sends `key` as a bearer (none without a key): what a
    client of a keyed server or scheduler sends, and `bearer_matches` checks."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def bearer_matches(authorization: str, expected: str) -> bool:
    """Whether an `Authorization` header value is `Bearer <expected>`, compared in constant time.

    The token is compared as bytes: `hmac.compare_digest` refuses a str with non-ASCII
    characters, which would turn a wrong key into a 500 instead of a 401.
    """
    scheme, _, given = authorization.partition(" ")
    given_bytes = given.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(given_bytes, expected.encode())


def error_body(message: str, code: int, error_type: str = INVALID_REQUEST) -> dict[str, Any]:
    """The error shape of every endpoint: `{"error": {"message", "type", "code"}}`."""
    return {"error": {"message": message, "type": error_type, "code": code}}


def routing_error_body(
    code: int, description: str, method: str, path: str, allowed: list[str] | None = None
) -> dict[str, Any]:
    """The body of an error raised before any handler ran (an unknown route, a method the
    route does not take, a body too large), for every path and method alike."""
    if code == 404:
        return error_body(f"there is no route {method} {path}", 404, NOT_FOUND)
    if code == 405:
        allowed_text = ", ".join(m for m in allowed or () if m not in ("HEAD", "OPTIONS"))
        message = f"{method} is not allowed on {path}; it takes {allowed_text or 'no method'}"
        return error_body(message, 405)
    return error_body(description, code, SERVER_ERROR if code >= 500 else INVALID_REQUEST)


def too_deep(what: str) -> str:
    """The 400 message for JSON nested past MAX_JSON_DEPTH."""
    return f"{what} nests deeper than {MAX_JSON_DEPTH} levels, the limit of this server"


def parse_json_object(data: bytes) -> dict[str, Any]:
    """A request body as a JSON object; raises ValueError with the client's message otherwise
    (a body nested past MAX_JSON_DEPTH included, refused before it is parsed)."""
    if nests_too_deep(data):
        raise ValueError(too_deep("the body"))
    try:
        body = json.loads(data or b"null", parse_constant=_refuse_constant, parse_float=_finite)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    if _SURROGATE_ESCAPE.search(data):
        where = _lone_surrogate_at(body)
        if where is not None:
            raise ValueError(f"{where} holds a lone UTF-16 surrogate escape, not a character")
    return body


def _refuse_constant(name: str) -> float:
    """NaN, Infinity and -Infinity: Python's json reads them, JSON (RFC 8259) has no such
    values; taken, they reach sampling parameters and schemas, and a proxy that writes the body
    again cannot (the scheduler)."""
    raise ValueError(f"{name} is not a JSON value (RFC 8259 has no NaN or infinities)")


def _finite(text: str) -> float:
    """A JSON number as a float, refused where it overflows one (1e400 would read as inf)."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is out of a float's range")
    return value


# A \uD800-\uDFFF escape: JSON admits one without its pair, which parses to a str that no
# tokenizer, path or log line can encode (a 500 before this check). A pair is one character.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate_at(body: dict[str, Any]) -> str | None:
    """Which field of `body` holds a lone surrogate in a string (a key or a value), named as
    `'messages[0].content'`; None where none does. Iterative: the depth is bounded already,
    the width is not."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if not _encodes(key):
                    return f"a key of {repr(path) if path else 'the body'}"
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str) and not _encodes(value):
            return repr(path)
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def shown(name: str, limit: int = MAX_NAME_SHOWN) -> str:
    """A client's name as an error message echoes it: cut to `limit` characters, so that a
    megabyte of name does not make a megabyte of error."""
    return name if len(name) <= limit else f"{name[:limit]}... ({len(name)} characters)"


def unknown_adapter(name: str) -> str:
    """The 404 message (type NOT_FOUND) for a model or adapter name nobody serves; a name past
    MAX_NAME_SHOWN characters is cut there (a name is as long as the body lets a client make it)."""
    if len(name) > MAX_NAME_SHOWN:
        return f"adapter {name[:MAX_NAME_SHOWN]!r}... ({len(name)} characters) does not exist"
    return f"adapter {name!r} does not exist"


def too_many_requests(max_in_flight: int) -> str:
    """The 429 message (type TOO_MANY_REQUESTS) past --max-concurrent-requests."""
    return (
        f"{max_in_flight} requests are in flight, the most this process takes "
        f"(--max-concurrent-requests); retry after the Retry-After delay"
    )


def error_response(message: str, code: int, error_type: str = INVALID_REQUEST) -> Response:
    """A Flask response of `error_body` with status `code`."""
    from flask import jsonify

    response = jsonify(error_body(message, code, error_type))
    response.status_code = code
    return response


class HttpError(Protocol):
    """An exception answered as an error body: its str() is the message."""

    code: int
    error_type: str
    retry_after_s: int | None


# Refusals of load, not of the request (429 past a limit, 503 draining): counted in /metrics, not
# logged one line each (a flood of them would be a flood of lines)
QUIET_REFUSALS = (429, 503)
# Every answer of server and scheduler carries the request's id: the client's own where it sent a
# usable one (a proxy's, a tracing system's), else one made here; the lines the request logs
# carry it too, and the scheduler sends it on to the server it routes to.
REQUEST_ID_HEADER = "X-Request-Id"
_USABLE_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


def request_id() -> str:
    """The id of the HTTP request being answered (in a Flask request context): its
    `X-Request-Id` where that is 1-128 characters of letters, digits and ._:/+=@-, else a
    random one, the same for the whole request."""
    from flask import g, request

    rid = getattr(g, "request_id", None)
    if rid is None:
        sent = request.headers.get(REQUEST_ID_HEADER, "")
        rid = g.request_id = sent if _USABLE_ID.fullmatch(sent) else uuid.uuid4().hex
    return rid


def install_error_handlers(
    app: Flask,
    logger: logging.Logger,
    *errors: type[Exception],
    bad_input: tuple[type[Exception], ...] = (),
) -> None:
    """Answer every error of `app` with the contract's body, as both processes do.

    `errors` carry `code`, `error_type` and `retry_after_s` (HttpError; a Retry-After header when
    set); `bad_input` are answered 400 invalid_request_error with their message; a routing error
    (unknown route, method not allowed, body too large) gets `routing_error_body`, with the
    Allow header of a 405 kept; anything else is logged and answered 500. A refusal of the
    request itself (a 4xx but 429, at INFO; a 5xx but 503, at WARNING) is logged in one line:
    method, path, request id, status and message. Every answer carries the request's id
    (`request_id`, header `X-Request-Id`).
    """
    # Flask is imported in the functions so that the engine, which imports this module for its
    # messages, does not load the web stack.
    from flask import request
    from werkzeug.exceptions import HTTPException

    def contract_error(e: HttpError) -> Response:
        if e.code not in QUIET_REFUSALS:  # one line: what and why (a client's mistake: INFO)
            level = logging.WARNING if e.code >= 500 else logging.INFO
            logger.log(level, "%s %s [%s]: %d %.300r", request.method, request.path,
                       request_id(), e.code, str(e))  # fmt: skip
        response = error_response(str(e), e.code, e.error_type)
        if e.retry_after_s is not None:
            response.headers["Retry-After"] = str(e.retry_after_s)
        return response

    def client_error(e: Exception) -> Response:
        logger.info("%s %s [%s]: 400 %.300r", request.method, request.path, request_id(), str(e))
        return error_response(str(e), 400)

    def http_error(e: HTTPException) -> Response:
        response = e.get_response()  # keeps headers such as Allow on a 405
        allowed = getattr(e, "valid_methods", None)
        body = routing_error_body(
            e.code or 500, e.description or e.name, request.method, request.path, allowed
        )
        response.data = json.dumps(body)
        response.content_type = "application/json"
        return response

    def unexpected(e: Exception) -> Response:
        logger.exception("unexpected error on %s %s [%s]", request.method, request.path,
                         request_id())  # fmt: skip
        return error_response(f"internal error: {type(e).__name__}: {e}", 500, SERVER_ERROR)

    for error in errors:
        app.register_error_handler(error, contract_error)
    for error in bad_input:
        app.register_error_handler(error, client_error)
    app.register_error_handler(HTTPException, http_error)
    app.register_error_handler(Exception, unexpected)

    @app.after_request
    def echo_request_id(response: Response) -> Response:
        response.headers[REQUEST_ID_HEADER] = request_id()
        return response
