"""What the resolver loads and unloads through, and the errors it answers with.

`Registrar` is the part of the operator's endpoints the resolver uses
(server.api.admin.lifecycle's AdapterAdmin); `busy` is its 503 with Retry-After (no room for a
cold adapter now: another server, or this one a moment later, may serve it), `as_client_error`
a loader's refusal as the client's error.
"""

from __future__ import annotations

from typing import Protocol

from toppings.gpu_lora.host_memory import ContentKey
from toppings.gpu_lora.peft.adapter import LoraAdapter
from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.errors import (
    NOT_FOUND,
    RETRY_AFTER_S,
    UNAVAILABLE,
    unknown_adapter,
)
from toppings.server.requests.request import RequestError


class Registrar(Protocol):
    """Registers and unregisters adapters in the steps of the operator's endpoints
    (server.api.admin.lifecycle's AdapterAdmin; RequestError on refusal)."""

    def check(self, body: dict) -> tuple[str, str]:
        """`{"lora_name", "lora_path"}` -> the name and the real directory, checked."""
        ...

    def open(self, name: str, path: str) -> LoraAdapter:
        """Read and check a checked directory (any thread: the reader pool's)."""
        ...

    def register(self, adapter: LoraAdapter, content: ContentKey | None = None) -> AdapterRef: ...

    def retire(self, name: str) -> LoraAdapter:
        """Unregister `name` (404, or 409 while in use), not waiting for the engine's step."""
        ...


def busy(message: str) -> RequestError:
    return RequestError(message + "; retry after the Retry-After delay", 503, UNAVAILABLE,
                        retry_after_s=RETRY_AFTER_S)  # fmt: skip


def as_client_error(name: str, exc: RequestError) -> RequestError:
    """A loader's 404 names a directory; the client named an adapter."""
    if exc.code == 404:
        return RequestError(unknown_adapter(name), 404, NOT_FOUND)
    return exc
