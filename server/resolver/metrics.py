"""The resolver's Prometheus series, in the server's registry (server.api.metrics makes it).

One resolution is one look-up of a name that was not registered, shared by every request that
asked for that name while it ran; its outcome is one of `Outcome`. Its time runs from the first
request's miss to the adapter registered (or the failure), eviction to make room included.
"""

from __future__ import annotations

import enum
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from toppings.server.requests.errors import NOT_FOUND, UNAVAILABLE
from toppings.server.requests.request import RequestError

WAIT_BOUNDS = ("max_loading", "max_adapters")  # the `bound` label of a wait
RESOLUTION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Outcome(enum.Enum):
    """How a resolution ended (the `outcome` label)."""

    LOADED = "loaded"  # registered; the requests that waited for it go on
    NOT_FOUND = "not_found"  # the source has no adapter of that name (404)
    REFUSED = "refused"  # found but refused: a path leaving the source, a bad adapter (4xx)
    BUSY = "busy"  # no room: resolutions in flight or resident adapters at their bound (503)
    FAILED = "failed"  # anything else (5xx)

    @classmethod
    def of(cls, error: RequestError) -> Outcome:
        if error.error_type == NOT_FOUND:
            return cls.NOT_FOUND
        if error.error_type == UNAVAILABLE:
            return cls.BUSY
        return cls.REFUSED if error.code < 500 else cls.FAILED


class ResolverMetrics:
    """Resolutions by outcome, their time, their waits at the resolver's bounds, resolver
    evictions, resolved adapters held, and the host tier's hits and bytes."""

    def __init__(self, registry: CollectorRegistry, prefix: str):
        """prefix: the server's series prefix (`toppings:`)."""
        self.resolutions = Counter(prefix + "lora_resolutions",
                                   "Look-ups of adapter names that were not registered, by "
                                   "outcome", ["outcome"], registry=registry)  # fmt: skip
        for outcome in Outcome:
            self.resolutions.labels(outcome.value)  # every series exists from the start
        self.seconds = Histogram(prefix + "lora_resolution_seconds",
                                 "Time of a resolution, from the first request's miss to the "
                                 "adapter registered or refused", buckets=RESOLUTION_BUCKETS,
                                 registry=registry)  # fmt: skip
        self.waits = Histogram(prefix + "lora_resolver_wait_seconds",
                               "Time a resolution waited at a bound of the resolver, whether it "
                               "then went on or got its 503: bound=max_loading for a resolution "
                               "slot, max_adapters for a resolved adapter to be let go",
                               ["bound"], buckets=RESOLUTION_BUCKETS,
                               registry=registry)  # fmt: skip
        for bound in WAIT_BOUNDS:
            self.waits.labels(bound)
        self.evictions = Counter(prefix + "lora_resolver_evictions",
                                 "Resolved adapters unloaded to make room for another",
                                 registry=registry)  # fmt: skip
        self.resolved = Gauge(prefix + "lora_resolved_adapters",
                              "Adapters the resolver registered and still holds",
                              registry=registry)  # fmt: skip
        self.host_hits = Counter(prefix + "lora_resolver_host_hits",
                                 "Resolutions of an adapter kept in host memory since its "
                                 "eviction (registered without reading its files)",
                                 registry=registry)  # fmt: skip
        self.host_bytes = Gauge(prefix + "lora_resolver_host_bytes",
                                "Host bytes of evicted resolved adapters kept for their next "
                                "resolution (--lora-resolver-host-bytes)",
                                registry=registry)  # fmt: skip

    def observe(self, outcome: Outcome, seconds: float | None) -> None:
        """One resolution ended; `seconds` None for one refused before it began (busy)."""
        self.resolutions.labels(outcome.value).inc()
        if seconds is not None:
            self.seconds.observe(seconds)

    def waited(self, bound: str, since: float | None) -> None:
        """A wait at `bound` (WAIT_BOUNDS) that began at `since` (time.monotonic) ended now;
        nothing where it never began (None)."""
        if since is not None:
            self.waits.labels(bound).observe(time.monotonic() - since)
