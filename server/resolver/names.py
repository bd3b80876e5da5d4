"""How a generation route turns a request's adapter name into a reference: `AdapterNames`.

A route opens one `lease()` per HTTP request, resolves the name through the callable it yields,
submits the engine requests, and leaves the block. From the moment the engine accepts a request
its in-flight count keeps the adapter registered (server.adapters.registry); the lease
covers the moment before, between the name's resolution and the submission, so that nothing
unloads an adapter a request has resolved but not yet submitted.

`RegisteredNames` is the server without a resolver: registered names only, nothing to hold.
`ResolvedAdapters` (server.resolver.resolved) also loads names found by a source.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

from toppings.server.requests.adapter_ref import AdapterRef

Resolve = Callable[[str | None], AdapterRef | None]


class NameTable(Protocol):
    """The engine's registered names (server.engine.client.EngineClient has it)."""

    def resolve_adapter(self, name: str | None) -> AdapterRef | None:
        """The reference of `name` (None: the base model); RequestError 404 when unknown."""
        ...


class AdapterNames(Protocol):
    """Resolves request adapter names for one HTTP request at a time (module docstring);
    `finds_unregistered`: whether a name nobody registered may still be found (a resolver)."""

    finds_unregistered: bool

    def lease(self) -> contextlib.AbstractContextManager[Resolve]: ...


class RegisteredNames:
    """Registered names only: a name nobody registered is a 404."""

    finds_unregistered = False

    def __init__(self, table: NameTable):
        self.table = table

    @contextlib.contextmanager
    def lease(self) -> Iterator[Resolve]:
        yield self.table.resolve_adapter
