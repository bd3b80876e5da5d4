"""The registered adapters by name, and how many accepted requests use each one.

`add` makes a registration's `AdapterRef` the one its name resolves to; `resolve` turns a
client's name into it (the API does it once per request). A request counts as in flight for its
adapter from `acquire`, when the engine accepts it, until `release`, when it ends on any path;
`retire` (an unload) is refused while any request is in flight for the adapter, and from the
moment it succeeds no request can acquire that reference again, so an accepted request never
loses its adapter. The counts are per id: a request of an earlier registration of a name never
counts for a later one. Any thread may call every method (one lock, held briefly).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.errors import NOT_FOUND, unknown_adapter
from toppings.server.requests.request import RequestError


class AdapterRegistry:
    """Name -> current `AdapterRef`, and per-id in-flight counts; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, AdapterRef] = {}
        self._in_flight: Counter[int] = Counter()  # ref id -> accepted requests not ended

    def check_free(self, name: str) -> None:
        """409 when `name` is registered (a load checks before it reads and holds anything)."""
        with self._lock:
            if name in self._by_name:
                raise RequestError(f"adapter {name!r} is already loaded", 409, "conflict")

    def add(self, ref: AdapterRef) -> None:
        """Make `ref` what its name resolves to (409 when the name is registered)."""
        with self._lock:
            if ref.name in self._by_name:
                raise RequestError(f"adapter {ref.name!r} is already loaded", 409, "conflict")
            self._by_name[ref.name] = ref

    def resolve(self, name: str | None) -> AdapterRef | None:
        """The reference registered under `name` (None for None: the base model); 404 when
        no adapter has that name."""
        if name is None:
            return None
        with self._lock:
            ref = self._by_name.get(name)
        if ref is None:
            raise RequestError(unknown_adapter(name), 404, NOT_FOUND)
        return ref

    def refs(self) -> list[AdapterRef]:
        """Every registered reference, in registration order (a copy: any thread)."""
        with self._lock:
            return list(self._by_name.values())

    def acquire(self, refs: Iterable[AdapterRef | None]) -> None:
        """Count one request in flight for each adapter of `refs` (None: the base model), all
        or none: 404 when one was unloaded since it was resolved."""
        wanted = [r for r in refs if r is not None]
        for ref in wanted:
            if not isinstance(ref, AdapterRef):  # an in-process caller passing a name
                raise TypeError(f"a request names its adapter by reference, not {ref!r}: "
                                "Engine.resolve_adapter(name) gives it")  # fmt: skip
        with self._lock:
            for ref in wanted:
                if self._by_name.get(ref.name) != ref:
                    raise RequestError(unknown_adapter(ref.name), 404, NOT_FOUND)
            self._in_flight.update(r.id for r in wanted)

    def release(self, ref: AdapterRef | None) -> None:
        """A request counted by `acquire` ended."""
        if ref is None:
            return
        with self._lock:
            left = self._in_flight[ref.id] - 1
            if left < 0:
                raise RuntimeError(f"adapter {ref.name!r} released more often than acquired")
            if left:
                self._in_flight[ref.id] = left
            else:
                del self._in_flight[ref.id]  # no entry kept per id ever used

    def in_flight(self, ref: AdapterRef) -> int:
        """Requests accepted for `ref` that have not ended."""
        with self._lock:
            return self._in_flight[ref.id]

    def retire(self, name: str) -> AdapterRef:
        """Unregister `name` and return its reference: 404 when no adapter has that name, 409
        while a request accepted for it has not ended (retry when they end)."""
        with self._lock:
            ref = self._by_name.get(name)
            if ref is None:
                raise RequestError(unknown_adapter(name), 404, NOT_FOUND)
            users = self._in_flight[ref.id]
            if users:
                raise RequestError(
                    f"adapter {name!r} is in use by {users} requests; retry when they end",
                    409, "conflict",
                )  # fmt: skip
            del self._by_name[name]
            return ref
