"""The HTTP error contract shared by the inference server and the cluster scheduler.

Every error of either process is answered as `{"error": {"message", "type", "code"}}` with HTTP
status `code`; a client mistake is a 4xx and the process keeps serving. This module is the
contract itself, so it imports nothing from toppings: the scheduler, which knows servers only
through HTTP, imports this module (with stats_schema and frontend, alike free of
toppings imports) and nothing else of the server package.

The messages a client can get from both processes for the same input (a body that is not JSON,
an unknown model) are made here, so that they read the same whichever process answers.
"""

from __future__ import annotations

import json
from typing import Any

# Error types (the "type" field), OpenAI's names where OpenAI has one.
INVALID_REQUEST = "invalid_request_error"  # 400: the client's body or parameters
AUTHENTICATION = "authentication_error"  # 401
NOT_FOUND = "not_found"  # 404: an unknown adapter, model, path or resource
CONFLICT = "conflict"  # 409
TOO_MANY_REQUESTS = "too_many_requests"  # 429: as many requests in flight as the limit allows
INSUFFICIENT_STORAGE = "insufficient_storage"  # 507: the adapter cache is full
UNAVAILABLE = "unavailable"  # 503: draining, shutting down, or no server ready yet
NO_SERVER_AVAILABLE = "no_server_available"  # 503: the scheduler has no server for the model
BAD_GATEWAY = "bad_gateway"  # 502: the scheduler got no answer from any server
SERVER_ERROR = "server_error"  # 500: a bug or an engine failure

NO_SERVER_READY = "no server ready yet"
RETRY_AFTER_S = 1  # the Retry-After of a 503 answered before any server is ready, and of a 429


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


def parse_json_object(data: bytes) -> dict[str, Any]:
    """A request body as a JSON object; raises ValueError with the client's message otherwise."""
    try:
        body = json.loads(data or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    return body


def unknown_adapter(name: str) -> str:
    """The 404 message (type NOT_FOUND) for a model or adapter name nobody serves."""
    return f"adapter {name!r} does not exist"


def too_many_requests(max_in_flight: int) -> str:
    """The 429 message (type TOO_MANY_REQUESTS) past --max-concurrent-requests."""
    return (
        f"{max_in_flight} requests are in flight, the most this process takes "
        f"(--max-concurrent-requests); retry after the Retry-After delay"
    )
