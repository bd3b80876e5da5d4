"""How many generation requests the HTTP front end has in flight, and the waitress it runs on.

A handler takes a `Slot` before it submits a request and gives it back when the answer has
ended, however it ends: finished, failed, refused by the engine, or cut by a client that went
away before or during the stream. Past `max_in_flight` a request is refused at once (the caller
answers 429 with Retry-After), never queued behind busy handler threads. Where the limit keeps
a tenant's share (`tenant_share`), a slot is then assigned to its tenant (`assign`, once
the request names it): while the process serves several tenants (`several`: it has adapters,
or finds them on first use), no tenant holds more than that share, so one tenant's flood
cannot take every place and leave the others only 429s (the flood takes its share, and the
other places are there for whoever comes next); a process of the base model alone keeps its
whole limit for it.

Waitress runs each request in flight, a stream included, on one thread of its pool, which is
sized from the limit plus a reserve: requests in flight never wait for a thread, and the
operator endpoints (/health, /stats, /metrics, adapter load/unload) and the quick 429s always
find one. A client that stops reading holds only its own thread: waitress buffers its output
(up to 16 MiB, then that thread alone waits).

Imports nothing else of toppings: the scheduler, which fronts its proxied streams the same way,
uses it (the limit, and `InFlightCollector` for its /metrics) as it uses `server.requests.errors`.
"""

from __future__ import annotations

import logging
import resource
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

logger = logging.getLogger(__name__)

IN_FLIGHT_PER_BATCH_SLOT = 4  # default limit: 4x the max batch size (queued requests count too)
TENANT_SHARE = 0.75  # of a server's requests in flight, the most one adapter (tenant) holds
DEFAULT_RESERVE_THREADS = 8  # waitress threads beyond the limit
CONNECTIONS_PER_THREAD = 2  # room for idle keep-alive connections and clients being refused
SPARE_FILES = 256  # open files beside the connections: model, shared memory, pipes, logs
DEFAULT_HEADER_TIMEOUT_S = 10  # a connection silent this long with no request running closes
CLEANUP_INTERVAL_S = 1  # how often waitress looks for such connections


def default_max_in_flight(max_batch_size: int) -> int:
    """The default limit: well above the batch, so that admission (batch, KV) is what binds."""
    return IN_FLIGHT_PER_BATCH_SLOT * max_batch_size


class Slot:
    """One request's place in flight (`units` of the limit); `release()` is idempotent and
    thread-safe."""

    def __init__(self, limit: InFlightLimit, units: int = 1):
        self._limit = limit
        self.units = units
        self.tenant: str | None = None  # set by InFlightLimit.assign
        self._released = False

    def release(self) -> None:
        self._limit._release(self)


class InFlightLimit:
    """Counts requests in flight (or another weight of them: `units` a request) and refuses,
    without blocking, the one that would pass `max_in_flight`; with a `tenant_share` below 1,
    while `several()` (the process serves several tenants now), also the one that would take
    its tenant past `max_per_tenant`, that share of the limit rounded up (the rest is kept for
    the other tenants; a limit below 4 keeps none)."""

    def __init__(
        self,
        max_in_flight: int,
        tenant_share: float = 1.0,
        several: Callable[[], bool] = lambda: True,
    ):
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be positive")
        self.max_in_flight = max_in_flight
        self.max_per_tenant = max_in_flight - int(max_in_flight * (1.0 - tenant_share))
        self._lock = threading.Lock()
        self._num_in_flight = 0
        self._num_rejected = 0
        self._tenants: dict[str, int] = {}  # units in flight per tenant that holds any
        self._several = several

    def try_acquire(self, units: int = 1) -> Slot | None:
        """A slot of `units`, or None (and one more rejection counted) when they would pass
        the limit."""
        with self._lock:
            if self._num_in_flight + units > self.max_in_flight:
                self._num_rejected += 1
                return None
            self._num_in_flight += units
            return Slot(self, units)

    def assign(self, slot: Slot, tenant: str, who: str) -> str | None:
        """Count `slot` as `tenant`'s (`who`, its name in a message: "adapter 'x'"); None, or
        the refusal (answered 429 with Retry-After: the slot stays held and unassigned, one
        more rejection is counted) when that would pass `max_per_tenant`."""
        shared = self.max_per_tenant < self.max_in_flight and self._several()
        with self._lock:
            held = self._tenants.get(tenant, 0)
            if shared and held + slot.units > self.max_per_tenant:
                self._num_rejected += 1
                return (
                    f"{who} has {held} requests in flight, the most one tenant holds "
                    f"({self.max_per_tenant} of the {self.max_in_flight} of "
                    f"--max-concurrent-requests: the rest is kept for others); retry after "
                    f"the Retry-After delay"
                )
            self._tenants[tenant] = held + slot.units
            slot.tenant = tenant
            return None

    def tenant_in_flight(self, tenant: str) -> int:
        return self._tenants.get(tenant, 0)

    def _release(self, slot: Slot) -> None:
        with self._lock:
            if not slot._released:
                slot._released = True
                self._num_in_flight -= slot.units
                if slot.tenant is not None:
                    left = self._tenants[slot.tenant] - slot.units
                    if left:
                        self._tenants[slot.tenant] = left
                    else:
                        del self._tenants[slot.tenant]

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    @property
    def num_rejected(self) -> int:
        """Requests refused since start (a counter)."""
        return self._num_rejected


class ReleasingBody:
    """A WSGI response body that runs `on_close` once when the server closes it.

    An iterator object rather than a generator: the WSGI server calls `close()` when the answer
    ends or the client goes away, and a generator never started would skip its `finally` (its
    slot would stay taken forever). Also closed when its chunks run out or fail, and when it is
    dropped unclosed (a safety net: a slot that leaks wedges the server once the limit is
    reached).
    """

    def __init__(self, chunks: Iterable, *on_close: Callable[[], None]):
        self._chunks: Iterator = iter(chunks)
        self._on_close = (getattr(self._chunks, "close", None), *on_close)
        self._closed = False

    def __iter__(self) -> ReleasingBody:
        return self

    def __next__(self):
        try:
            return next(self._chunks)
        except BaseException:  # the end, or a failure: give back at once, not only on close()
            self.close()
            raise

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        error = None
        for fn in self._on_close:
            try:
                if fn is not None:
                    fn()
            except Exception as e:  # the others must still run: the slot above all
                error = error or e
        if error is not None:
            raise error

    def __del__(self) -> None:
        if not self._closed:
            logger.warning("a response body was dropped unclosed; releasing it")
            self.close()


def waitress_settings(
    max_in_flight: int, reserve_threads: int, idle_timeout_s: int = DEFAULT_HEADER_TIMEOUT_S
) -> dict[str, Any]:
    """`waitress.create_server` keywords for a front end of `max_in_flight` requests.

    One thread per request in flight plus the reserve; connections beyond the threads for idle
    keep-alive clients and clients being refused; poll() rather than select(), which cannot
    watch a socket numbered above 1023. A connection with no request running that sends
    nothing for `idle_timeout_s` (an idle keep-alive client, or one that sent half a header and
    stalled) is closed within a second more: waitress stops accepting at the connection limit,
    so stalled clients must not keep their places for long (its default is 120 s, checked every
    30 s).
    """
    if reserve_threads < 1:
        raise ValueError("reserve_threads must be positive")
    if idle_timeout_s < 1:
        raise ValueError("idle_timeout_s must be positive")
    threads = max_in_flight + reserve_threads
    return {
        "threads": threads,
        "connection_limit": CONNECTIONS_PER_THREAD * threads,
        "asyncore_use_poll": True,
        "channel_timeout": idle_timeout_s,
        "cleanup_interval": CLEANUP_INTERVAL_S,
    }


def raise_open_files_limit(num_connections: int) -> int:
    """Raise the soft limit on open files (up to the hard one) for `num_connections` sockets;
    returns the soft limit now in force."""
    need = num_connections + SPARE_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return soft
    new = need if hard == resource.RLIM_INFINITY else min(need, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    if new < need:
        logger.warning("open files limited to %d (hard limit); %d connections want %d",
                       new, num_connections, need)  # fmt: skip
    return new


# The series of an `InFlightLimit` beside what is in flight: its limit and its refusals (429),
# as (name, help) each; a limit of other units names its own (server.api.metrics).
REQUEST_LIMIT_SERIES = (
    ("max_concurrent_requests", "Requests in flight past which a request gets 429"),
    ("requests_rejected", "Requests refused with 429: too many in flight"),
)


class InFlightCollector:
    """Prometheus series of an `InFlightLimit`: what is in flight, the limit, refusals (429);
    `limit_series` names the last two (REQUEST_LIMIT_SERIES)."""

    def __init__(
        self, limit: InFlightLimit, prefix: str, in_flight_name: str, in_flight_help: str,
        limit_series: tuple[tuple[str, str], tuple[str, str]] = REQUEST_LIMIT_SERIES,
    ):  # fmt: skip
        self.limit = limit
        self._prefix, self._name, self._help = prefix, in_flight_name, in_flight_help
        self._series = limit_series

    def collect(self) -> Iterator[Metric]:
        p, limit = self._prefix, self.limit
        (max_name, max_help), (rejected_name, rejected_help) = self._series
        yield GaugeMetricFamily(p + self._name, self._help, value=limit.num_in_flight)
        yield GaugeMetricFamily(p + max_name, max_help, value=limit.max_in_flight)
        yield CounterMetricFamily(p + rejected_name, rejected_help, value=limit.num_rejected)
