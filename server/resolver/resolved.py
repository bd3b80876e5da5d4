"""Adapters loaded on first use: a name nobody registered is looked up in a source and loaded.

A fleet of a thousand adapters cannot register each on each server ahead of time, so a request
naming an unregistered adapter resolves it here (vLLM's LoRA resolvers, Dynamo's load-on-miss):

- One load per name: the first request for a name starts it (the read on the resolver's reader
  pool, server.resolver.preparer, the registration on the adapter thread as every load);
  requests for the same name meanwhile wait for it and share its result. A failed load fails
  every one of them with its error and leaves nothing behind, so a later request tries again.
- At most `max_loading` names resolve at once; one more waits for one of them to end, up to
  `max_wait_s` (`SLOT_WAIT_S`: a resolution takes a fraction of a second to a few seconds, so a
  burst of cold names is served in turn rather than refused), and past that gets 503 with
  Retry-After. 503, not 429: the client sent nothing wrong and is not over a rate, this server
  has no room for another cold adapter now (another server, or this one a moment later, may
  serve it), and 429 already means the process's --max-concurrent-requests here.
- A resolution waits for its read `max_resolve_s` at most (`RESOLVE_WAIT_S`), and a request for
  a name in resolution as long: then 503 and the slot freed, the read left to end on its thread
  (kept in the host tier if it succeeds). An adapter whose store hangs holds one reader, never
  the requests, nor the reads of other names (server.resolver.preparer).
- At most `max_adapters` resolved adapters are registered at once. A load past it first unloads
  the least recently used resolved adapter that no request holds (neither leased here nor in
  flight in the engine), while its own files are read; the unload does not wait for the
  engine's step (its device rows go at the next one: Engine.retire_adapter). When every one
  is held it waits for one to be let go, as a request waits for a slot, up to `max_wait_s`, then
  503 with Retry-After: a lease given back wakes it, the end of requests in the engine it sees
  by trying again (every HELD_POLL_S, doubling to HELD_POLL_MAX_S: the engine tells the resolver
  nothing, and each try asks the adapter thread). A burst of more cold names than the bound was
  refused at once before (45 of 400 requests of bench_adapter_scale's on-demand run, when its
  64 resolved adapters were all in use by waiting requests). Adapters the operator registered
  are never counted nor unloaded here; a name with no directory unloads nothing (an adapter its
  read refuses may have).
- A resolved adapter stays registered and serving until it is evicted, even if its directory is
  removed; the next resolution of that name, after the eviction, is then a clean 404.
- An evicted adapter stays in host memory, within `--lora-resolver-host-bytes`, while its files
  do not change (server.resolver.host_tier): resolving it again registers it without a read.

`lease()` (server.resolver.names) holds the adapters a request resolved until it has been
submitted, so that an eviction never pulls an adapter from between resolution and submission.
Loads go through the parts of /v1/load_lora_adapter's own load (`Registrar`: check, open,
register), with the source's root as the only allowed root: the same name, path, size and
dedupe checks.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass

from toppings.gpu_lora.host_memory import ContentKey
from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.errors import SERVER_ERROR
from toppings.server.requests.request import RequestError
from toppings.server.resolver.host_tier import FileKey, HostTier, Prepared
from toppings.server.resolver.metrics import Outcome, ResolverMetrics
from toppings.server.resolver.names import NameTable, Resolve
from toppings.server.resolver.preparer import Preparer
from toppings.server.resolver.registrar import Registrar, as_client_error, busy
from toppings.server.resolver.sources import AdapterSource

log = logging.getLogger(__name__)


@dataclass
class _Held:
    """A resolved adapter registered now; `leases`: requests between resolving and submitting;
    where it was read from, to keep it in the host tier once evicted."""

    ref: AdapterRef
    leases: int
    directory: str
    key: FileKey | None
    host_bytes: int


class _Load:
    """One resolution in flight, shared by every request that asked for its name meanwhile."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ref: AdapterRef | None = None
        self.error: RequestError | None = None
        self.num_waiting = 1  # the requests that get a lease when it lands, its starter included


SLOT_WAIT_S = 30.0  # how long a resolution waits for a slot (or a held adapter) before its 503
HELD_POLL_S = 0.05  # the first wait before trying the held adapters again, doubling
HELD_POLL_MAX_S = 0.5  # to at most this
RESOLVE_WAIT_S = 60.0  # how long a request waits for a resolution in flight before its 503


class ResolvedAdapters:
    """Registered names, and names a source finds, loaded on first use (module docstring)."""

    finds_unregistered = True

    def __init__(
        self,
        table: NameTable,
        source: AdapterSource,
        registrar: Registrar,
        metrics: ResolverMetrics,
        max_adapters: int,
        max_loading: int,
        max_wait_s: float = SLOT_WAIT_S,
        host_bytes: int = 0,
        max_parsing: int | None = None,
        max_resolve_s: float = RESOLVE_WAIT_S,
    ):
        """registrar: loads with `source.root` as its only allowed root; max_wait_s: how long a
        resolution waits for one of the `max_loading` to end before its 503; host_bytes: the
        host tier's bound (0: evicted adapters are not kept); max_parsing: reads that use the CPU
        at once (None: `max_loading`; server.resolver.preparer); max_resolve_s: how long a
        request waits for a resolution in flight before its 503."""
        if max_adapters < 1 or max_loading < 1:
            raise ValueError("max_adapters and max_loading must be positive")
        self.table, self.source, self.registrar = table, source, registrar
        self.metrics = metrics
        self.tier = HostTier(host_bytes)
        self.preparer = Preparer(registrar, self.tier, max_loading, max_parsing or max_loading)
        self.max_adapters, self.max_loading = max_adapters, max_loading
        self.max_wait_s, self.max_resolve_s = max_wait_s, max_resolve_s
        self._lock = threading.Lock()
        self._slot_freed = threading.Condition(self._lock)  # a resolution ended
        self._let_go = threading.Condition(self._lock)  # a lease given back
        self._held: OrderedDict[str, _Held] = OrderedDict()  # least recently used first
        self._loading: dict[str, _Load] = {}
        self._evicting: dict[str, threading.Event] = {}  # set once the unload ended
        self._num_reserved = 0  # loads that made room and will register

    # ---- the routes' side -----------------------------------------------------------------

    @contextlib.contextmanager
    def lease(self) -> Iterator[Resolve]:
        taken: list[AdapterRef] = []

        def resolve(name: str | None) -> AdapterRef | None:
            ref, leased = self._resolve(name)
            if leased:
                taken.append(ref)
            return ref

        try:
            yield resolve
        finally:
            with self._lock:
                for ref in taken:
                    held = self._held.get(ref.name)
                    if held is not None and held.ref == ref:
                        held.leases -= 1
                if taken:
                    self._let_go.notify_all()

    def resolved_names(self) -> list[str]:
        """The resolved adapters registered now, least recently used first."""
        with self._lock:
            return list(self._held)

    def _resolve(self, name: str | None) -> tuple[AdapterRef | None, bool]:
        """The reference for `name` and whether a lease was taken on it."""
        if name is None:
            return None, False
        deadline = time.monotonic() + self.max_wait_s
        waited = None  # when this request first found every resolution slot taken
        try:
            while True:
                starts = slot_taken = False
                with self._lock:
                    held = self._held.get(name)
                    if held is not None:
                        if self._still_registered(held.ref):
                            held.leases += 1
                            self._held.move_to_end(name)
                            return held.ref, True
                        del self._held[name]  # the operator unloaded it: resolve it again
                        self._count_held()
                    load = self._loading.get(name)
                    evicted = self._evicting.get(name)
                    if load is not None:
                        load.num_waiting += 1
                    elif evicted is None:
                        try:
                            return self.table.resolve_adapter(name), False  # the operator's
                        except RequestError as exc:
                            if exc.code != 404:
                                raise
                        if len(self._loading) < self.max_loading:
                            load, starts = self._start(name), True
                        else:  # every slot taken: wait for one, then look again
                            slot_taken, waited = True, waited or time.monotonic()
                            left = deadline - time.monotonic()
                            freed = left > 0 and self._slot_freed.wait(left)
                            if not freed and len(self._loading) >= self.max_loading:
                                self._refuse()
                if slot_taken:
                    continue
                self.metrics.waited("max_loading", waited)  # a slot, or no need of one
                waited = None
                if evicted is not None:
                    evicted.wait()  # then resolve it afresh
                    continue
                if starts:
                    self._run(name, load)
                self._wait(name, load)
                if load.error is not None:
                    e = load.error
                    raise RequestError(str(e), e.code, e.error_type, e.retry_after_s)
                return load.ref, True
        finally:
            self.metrics.waited("max_loading", waited)

    def _wait(self, name: str, load: _Load) -> None:
        """Wait for `load` up to `max_resolve_s`; then 503, and no lease on it when it lands."""
        if load.done.wait(self.max_resolve_s):
            return
        with self._lock:
            if load.done.is_set():
                return
            load.num_waiting -= 1
        raise busy(f"adapter {name!r} is still being resolved after {self.max_resolve_s:g} s "
                   f"(its files are read from {self.source.root})")  # fmt: skip

    def _still_registered(self, ref: AdapterRef) -> bool:
        try:
            return self.table.resolve_adapter(ref.name) == ref
        except RequestError:
            return False

    # ---- one resolution --------------------------------------------------------------------

    def _refuse(self) -> None:
        """503: every resolution slot stayed taken for as long as a request waits."""
        self.metrics.observe(Outcome.BUSY, None)
        raise busy(f"{self.max_loading} adapters are being resolved, the most this server "
                   f"resolves at once (--lora-resolver-max-loading), and none ended within "
                   f"{self.max_wait_s:g} s")  # fmt: skip

    def _start(self, name: str) -> _Load:
        """A new resolution of `name` (lock held, a slot free)."""
        load = _Load()
        self._loading[name] = load
        return load

    def _run(self, name: str, load: _Load) -> None:
        """Locate, read (or take from the host tier), make room, register; then wake every
        request waiting for `name`."""
        started = time.monotonic()
        outcome, reserved, prepared = Outcome.FAILED, 0, None
        try:
            path = self.source.locate(name)
            _, directory = self.registrar.check({"lora_name": name, "lora_path": path})
            reading = self.preparer.start(name, directory)
            try:
                reserved = self._make_room()  # 1 from here: released when the load lands
            except BaseException:
                self._keep_when_read(reading)
                raise
            prepared, kept = self._read_result(name, reading)  # the read's RequestError
            load.ref = self.registrar.register(prepared.adapter, prepared.content)
            outcome = Outcome.LOADED
            if kept:
                self.metrics.host_hits.inc()
            log.info("resolved adapter %s from %s%s", name, self.source.root,
                     " (kept in host memory)" if kept else "")  # fmt: skip
        except RequestError as exc:
            load.error = as_client_error(name, exc)
            outcome = Outcome.of(load.error)
        except Exception as exc:
            log.exception("resolving adapter %s failed", name)
            load.error = RequestError(f"resolving adapter {name!r} failed: {exc}", 500,
                                      SERVER_ERROR)  # fmt: skip
        finally:
            if load.ref is None and load.error is None:  # interrupted
                load.error = RequestError(f"resolving adapter {name!r} was interrupted", 500,
                                          SERVER_ERROR)  # fmt: skip
            if load.error is not None and prepared is not None:
                self._keep(prepared)  # read but not registered: the next try need not read it
            self._count_tier()  # a take from the tier, a keep
            with self._lock:
                del self._loading[name]
                self._slot_freed.notify_all()
                self._num_reserved -= reserved
                if load.error is None:
                    self._held[name] = _Held(load.ref, load.num_waiting, prepared.directory,
                                             prepared.key, prepared.host_bytes)  # fmt: skip
                self._count_held()
                load.done.set()  # under the lock: a waiter that gave up is not in its leases
            self.metrics.observe(outcome, time.monotonic() - started)

    def _make_room(self) -> int:
        """Reserve a place among `max_adapters`, unloading the least recently used unheld
        resolved adapters as needed; while every one is held, wait for one to be let go (up to
        `max_wait_s`, then 503). Returns the places reserved."""
        tried: set[AdapterRef] = set()
        deadline, poll_s = time.monotonic() + self.max_wait_s, HELD_POLL_S
        waited = None  # when every resolved adapter was first found held
        try:
            while True:
                with self._lock:
                    registered = len(self._held) + len(self._evicting) + self._num_reserved
                    if registered < self.max_adapters:
                        self._num_reserved += 1
                        return 1
                    victim = next((h for h in self._held.values()
                                   if h.leases == 0 and h.ref not in tried), None)  # fmt: skip
                    if victim is None:
                        pending = next(iter(self._evicting.values()), None)
                        if pending is None:  # every one held: wait, then try them all again
                            left = deadline - time.monotonic()
                            if left <= 0:
                                raise busy(f"all {self.max_adapters} resolved adapters are in use "
                                           "(--lora-resolver-max-adapters)")  # fmt: skip
                            waited = waited or time.monotonic()
                            self._let_go.wait(min(poll_s, left))
                            tried.clear()
                            poll_s = min(2 * poll_s, HELD_POLL_MAX_S)
                            continue
                    else:
                        del self._held[victim.ref.name]
                        self._evicting[victim.ref.name] = threading.Event()
                if victim is None:
                    pending.wait()  # another load's eviction ends: look again
                    continue
                tried.add(victim.ref)
                self._evict(victim)
        finally:
            self.metrics.waited("max_adapters", waited)

    def _evict(self, victim: _Held) -> None:
        """Unload `victim` into the host tier, or put it back when a request in flight in the
        engine holds it."""
        name = victim.ref.name
        unloaded = False
        placed = self.tier.reserve(victim.host_bytes)  # charged before the tier holds it
        try:
            held = self.registrar.retire(name)
            unloaded = True
            if placed and held.id == victim.ref.weights_id:  # what this resolver registered
                prepared = Prepared(held, ContentKey(held), victim.directory, victim.key)
                self.tier.fill(victim.host_bytes, prepared)
                placed = False
        except RequestError as exc:
            unloaded = exc.code == 404  # gone already (the operator unloaded it)
            if exc.code != 409:
                log.warning("evicting resolved adapter %s: %s", name, exc)
        finally:
            if placed:
                self.tier.cancel(victim.host_bytes)
            self._count_tier()
            with self._lock:
                event = self._evicting.pop(name)
                if not unloaded:
                    self._held[name] = victim  # in use: the most recently used in effect
                self._count_held()
            event.set()
        if unloaded:
            self.metrics.evictions.inc()
            log.info("evicted resolved adapter %s (least recently used)", name)

    def _read_result(self, name: str, reading: Future[tuple[Prepared, bool]]):
        """The read's result within `max_resolve_s`, else 503 (the read kept when it ends)."""
        try:
            return reading.result(timeout=self.max_resolve_s)
        except FuturesTimeout:
            reading.add_done_callback(self._keep_when_read)
            raise busy(f"adapter {name!r} is still being read from {self.source.root} after "
                       f"{self.max_resolve_s:g} s") from None  # fmt: skip

    def _keep_when_read(self, reading: Future[tuple[Prepared, bool]]) -> None:
        """Wait for a read whose adapter will not be registered now; keep it if it succeeded."""
        try:
            prepared, _ = reading.result()
        except Exception:  # noqa: BLE001 - its error is not this resolution's outcome
            return
        self._keep(prepared)

    def _keep(self, prepared: Prepared) -> None:
        """Keep an adapter read but not registered in the host tier, when it has room."""
        if self.tier.reserve(prepared.host_bytes):
            self.tier.fill(prepared.host_bytes, prepared)
        self._count_tier()

    def _count_held(self) -> None:
        self.metrics.resolved.set(len(self._held))

    def _count_tier(self) -> None:
        self.metrics.host_bytes.set(self.tier.charged_bytes)
