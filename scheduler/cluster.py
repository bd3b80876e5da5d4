"""The live view of the inference servers: registry records, `/stats` snapshots, health.

A background thread fetches every server's `/stats` every `refresh_s` (100 ms by default). The
requests the scheduler routed to a server after a fetch began are kept and added to that
server's state as queued (`ServerState.with_routed`), so a burst between two snapshots does not
pile onto the server the last snapshot favoured. A server whose fetch fails, or that refuses a
proxied request, is unhealthy until a fetch succeeds again.

With `kv_feeds` (prefix routing), each `/stats` also tells the feeds where the server
publishes its KV cache events (its `kv_events` field, scheduler/kv_index/feeds.py), and the
activated adapters' invocation sequences are kept for hashing their prompts
(`invocation_tokens`).

An adapter name no server has reported, routed to a server that loads names on first use (its
resolver), counts as that server's (loading) until its /stats shows the name, it answers 404 for
it (`resolve_failed`), it turns unhealthy, or RESOLVE_HOLD_S passes: the requests that follow the
first go where the name is being found, not to a second server that would load it too.

The cluster keeps `origins` (scheduler.server_session) in step with its membership: the servers'
key goes to a server from the moment an operator registers it (its first /v1/models and /stats
carry the key) until it is removed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from toppings.scheduler.kv_index.feeds import KVFeeds
from toppings.scheduler.registry import AdapterRecord, Registry, ServerRecord
from toppings.scheduler.server_session import ServerOrigins
from toppings.scheduler.state import RouteRequest, ServerState

log = logging.getLogger(__name__)

FetchJson = Callable[[str], dict[str, Any]]  # GET url -> JSON body; raises on any failure
LAST_SEEN_WRITE_S = 5.0  # how often a healthy server's last_seen reaches the registry
RESOLVE_HOLD_S = 60.0  # how long a name sent to a server to find stays its (unless /stats shows it)


@dataclass
class _Entry:
    record: ServerRecord
    snapshot: ServerState | None = None
    routed: list[tuple[float, RouteRequest]] = field(default_factory=list)
    healthy: bool = False
    hosted: frozenset[str] = frozenset()
    last_seen_written: float = 0.0
    last_error: str = ""
    in_flight: int = 0  # requests proxied here whose answer has not ended (the scheduler's count)
    snapshot_at: float = 0.0  # time.monotonic() of the last /stats that parsed
    resolving: dict[str, float] = field(default_factory=dict)  # name -> when routed, to be found
    # The names of the server's adapters as of its adapters_version (their residency is in each
    # /stats), sent back as adapters_since: an unchanged list is left out of the answer
    listed: tuple[int, frozenset[str]] | None = None


class Cluster:
    """Thread-safe set of servers; `states()` is what a policy routes on."""

    def __init__(
        self,
        registry: Registry,
        fetch_json: FetchJson,
        refresh_s: float = 0.1,
        origins: ServerOrigins | None = None,
        kv_feeds: KVFeeds | None = None,
    ):
        """origins: where the servers' key may go, kept to this cluster's servers (the same
        object the fetch_json's and the router's ServerSession ask); kv_feeds: the KV events
        subscriptions to keep in step with each server's /stats (None: none)."""
        self.kv_feeds = kv_feeds
        self._invocations: dict[str, tuple[int, ...]] = {}
        self.registry = registry
        self.fetch_json = fetch_json
        self.refresh_s = refresh_s
        self.origins = origins if origins is not None else ServerOrigins()
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        hosting = registry.hosting()
        for record in registry.list_servers():  # a restart picks up every known server
            hosted = frozenset(hosting.get(record.url, ()))
            self._entries[record.url] = _Entry(record, hosted=hosted)
            self.origins.add(record.url)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="stats")

    # --- membership ---------------------------------------------------------------------------

    def add_server(self, url: str) -> dict[str, Any]:
        """Fetch the server's /v1/models and /stats, record it and its adapters.

        The caller is the operator (an admin request, or the command line): `url` is trusted
        with the servers' key from here on, unless it cannot be registered.
        """
        url = url.rstrip("/")
        with self._lock:
            known = url in self._entries
        self.origins.add(url)
        try:
            models = self.fetch_json(url + "/v1/models")
            stats = self.fetch_json(url + "/stats")
            state = ServerState.from_stats(url, stats)
            base = str(stats["model"])
            ranks = {str(a["name"]): int(a["rank"]) for a in stats.get("adapters", ())}
            for card in models.get("data", ()):
                if card.get("parent") and card.get("rank"):
                    ranks.setdefault(str(card["id"]), int(card["rank"]))
        except BaseException:
            if not known:
                self.origins.discard(url)
            raise
        self._learn(url, stats)
        adapters = [AdapterRecord(name, base, rank) for name, rank in sorted(ranks.items())]
        record = ServerRecord(url, base, state.kernel, str(stats.get("device", "unknown")),
                              healthy=state.healthy, last_seen=time.time())  # fmt: skip
        self.registry.put_server(record, adapters)
        with self._lock:
            entry = self._entries.setdefault(url, _Entry(record))
            entry.record, entry.snapshot, entry.routed = record, state, []
            entry.snapshot_at = time.monotonic()
            entry.healthy, entry.hosted = state.healthy, frozenset(ranks)
        return {"url": url, "base_model": base, "kernel": state.kernel, "adapters": sorted(ranks)}

    def remove_server(self, url: str) -> bool:
        url = url.rstrip("/")
        with self._lock:
            known = self._entries.pop(url, None) is not None
        self.origins.discard(url)
        if self.kv_feeds is not None:
            self.kv_feeds.remove(url)
        return self.registry.remove_server(url) or known

    def urls(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def is_registered(self, url: str) -> bool:
        """Whether `url` (a trailing slash aside) is one of the cluster's servers."""
        with self._lock:
            return url.rstrip("/") in self._entries

    # --- what policies see --------------------------------------------------------------------

    def states(self) -> list[ServerState]:
        """One state per server that has a snapshot, in registration order (first-fit's order)."""
        with self._lock:
            entries = list(self._entries.values())
        result = []
        for entry in entries:
            state = entry.snapshot
            if state is None:
                continue
            for _, req in entry.routed:
                state = state.with_routed(req.rank, req.prompt_tokens, req.max_new_tokens)
            if state.healthy != entry.healthy:
                state = replace(state, healthy=entry.healthy)
            if entry.resolving:  # names it is finding: as if loading there
                names = frozenset(entry.resolving)
                state = replace(state, adapters=state.adapters | names,
                                loading_adapters=state.loading_adapters | names)  # fmt: skip
            result.append(state)
        return result

    def _learn(self, url: str, stats: dict[str, Any]) -> None:
        """What prefix routing takes from a parsed /stats: the KV events feed, and the
        activated adapters' invocation sequences."""
        for adapter in stats.get("adapters", ()):
            tokens = adapter.get("invocation_tokens")
            if tokens:
                self._invocations[str(adapter["name"])] = tuple(int(t) for t in tokens)
            else:  # a plain adapter (perhaps loaded again under an activated one's name)
                self._invocations.pop(str(adapter["name"]), None)
        if self.kv_feeds is not None:
            try:
                self.kv_feeds.update(url, stats.get("kv_events") or {})
            except (KeyError, TypeError, ValueError) as exc:  # a malformed field: no feed
                log.warning("server %s: unusable kv_events in /stats: %s", url, exc)
                self.kv_feeds.remove(url)

    def invocation_tokens(self, adapter: str) -> tuple[int, ...]:
        """An activated adapter's invocation sequence as its servers report it; () for any
        other adapter."""
        return self._invocations.get(adapter, ())

    def reach(self, adapter: str) -> tuple[bool, bool]:
        """Whether a registered server's last /stats shows `adapter` (or one is finding it), and
        whether one loads adapters on first use (up or not): what routing a name needs, without
        building every server's state as `states()` does."""
        with self._lock:
            finding = any(adapter in e.resolving for e in self._entries.values())
            snaps = [e.snapshot for e in self._entries.values() if e.snapshot is not None]
        hosted = finding or any(adapter in s.adapters for s in snaps)
        return hosted, any(s.resolves for s in snaps)

    def serves_adapters(self) -> bool:
        """Whether a registered server holds an adapter or finds them on first use: requests
        of several models (tenants) may come."""
        with self._lock:
            entries = list(self._entries.values())
        return any(e.hosted or (e.snapshot is not None and e.snapshot.resolves) for e in entries)

    def hosting(self) -> dict[str, frozenset[str]]:
        """Healthy server url -> the adapters its last /stats (or a confirmed fetch) showed."""
        with self._lock:
            return {url: e.hosted for url, e in self._entries.items() if e.healthy}

    def note_routed(self, url: str, request: RouteRequest) -> None:
        with self._lock:
            entry = self._entries.get(url)
            if entry is not None:
                entry.routed.append((time.monotonic(), request))
                if request.resolve and request.adapter is not None:
                    entry.resolving.setdefault(request.adapter, time.monotonic())

    def resolve_failed(self, url: str, adapter: str) -> None:
        """The server at `url` did not find `adapter` (it answered 404): the name is no longer
        its."""
        with self._lock:
            entry = self._entries.get(url)
            if entry is not None:
                entry.resolving.pop(adapter, None)

    def begin_request(self, url: str) -> None:
        """A proxied request to `url` starts; pair every call with one `end_request`."""
        with self._lock:
            entry = self._entries.get(url)
            if entry is not None:
                entry.in_flight += 1

    def end_request(self, url: str) -> None:
        with self._lock:
            entry = self._entries.get(url)
            if entry is not None and entry.in_flight > 0:
                entry.in_flight -= 1

    def mark_unhealthy(self, url: str, reason: str) -> None:
        with self._lock:
            entry = self._entries.get(url)
            if entry is None or not entry.healthy:
                return
            entry.healthy, entry.last_error = False, reason
            entry.resolving.clear()
        log.warning("server %s unhealthy: %s", url, reason)
        self.registry.set_health(url, False)

    def describe(self) -> list[dict[str, Any]]:
        """Per server: its record, health, and two counts of work that mean different things.

        "running"/"queued" are the server's own, from its last /stats that parsed, which is
        "snapshot_age_s" old: a server whose /stats fails (unhealthy) keeps its last numbers.
        "in_flight" is the scheduler's: proxied requests whose answer has not ended yet.
        """
        now = time.monotonic()
        with self._lock:
            entries = list(self._entries.values())
        return [
            {
                "url": e.record.url,
                "base_model": e.record.base_model,
                "kernel": e.record.kernel,
                "device": e.record.device,
                "healthy": e.healthy,
                "last_error": e.last_error,
                "adapters": sorted(e.hosted),
                "running": e.snapshot.num_running if e.snapshot else None,
                "queued": e.snapshot.num_queued if e.snapshot else None,
                "routed_since_snapshot": len(e.routed),
                "in_flight": e.in_flight,
                "snapshot_age_s": round(now - e.snapshot_at, 3) if e.snapshot else None,
            }
            for e in entries
        ]

    # --- refreshing ---------------------------------------------------------------------------

    def refresh_once(self) -> None:
        """Fetch every server's /stats (in parallel) and update snapshots and health."""
        list(self._pool.map(self.refresh, self.urls()))

    def refresh(self, url: str) -> None:
        """Fetch one server's /stats now and update its snapshot and health (the admin routes'
        after an adapter load or unload, so that routing knows before the next poll)."""
        began = time.monotonic()
        with self._lock:
            entry = self._entries.get(url)
            listed = entry.listed if entry is not None else None
        try:
            since = f"?adapters_since={listed[0]}" if listed is not None else ""
            stats = self.fetch_json(f"{url}/stats{since}")
            state = ServerState.from_stats(url, stats, listed[1] if listed is not None else None)
        except Exception as exc:  # any failure (refused, timeout, bad JSON) means unhealthy
            self.mark_unhealthy(url, f"/stats: {type(exc).__name__}: {exc}")
            return
        now = time.time()
        with self._lock:
            removed = url not in self._entries
        if not removed:
            self._learn(url, stats)
        with self._lock:
            entry = self._entries.get(url)
            if entry is None:  # removed meanwhile
                return
            was_healthy, entry.healthy = entry.healthy, state.healthy
            entry.snapshot, entry.snapshot_at = state, time.monotonic()
            if not stats.get("adapters_unchanged"):
                version = stats.get("adapters_version")  # None: a server without it
                entry.listed = (int(version), state.adapters) if version is not None else None
            entry.routed = [(t, r) for t, r in entry.routed if t >= began]
            held = entry.snapshot_at - RESOLVE_HOLD_S
            entry.resolving = {
                name: t
                for name, t in entry.resolving.items()
                if t > held and state.healthy and name not in state.adapters
            }
            hosted_changed = state.adapters != entry.hosted
            entry.hosted = state.adapters
            write_seen = now - entry.last_seen_written >= LAST_SEEN_WRITE_S
            if write_seen or was_healthy != state.healthy:
                entry.last_seen_written = now
        if hosted_changed:
            ranks = {str(a["name"]): int(a["rank"]) for a in stats.get("adapters", ())}
            record = ServerRecord(url, entry.record.base_model, state.kernel, entry.record.device,
                                  state.healthy, now)  # fmt: skip
            adapters = [AdapterRecord(n, record.base_model, r) for n, r in sorted(ranks.items())]
            self.registry.put_server(record, adapters)
        elif write_seen or was_healthy != state.healthy:
            self.registry.set_health(url, state.healthy, now)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="stats-refresh", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.refresh_once()
            except Exception:  # never let the refresher die; the next round retries
                log.exception("stats refresh failed")
            self._stop.wait(max(0.0, self.refresh_s - (time.monotonic() - started)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False)
        if self.kv_feeds is not None:
            self.kv_feeds.close()
