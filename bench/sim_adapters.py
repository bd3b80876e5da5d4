"""The adapter side of the simulated engine (bench/sim_engine.py): what the scheduler's admission
gate asks of the engine's AdapterManager (server/sched/admission.py `Adapters`), in pure Python.

`SimAdapters`: every adapter is on the device at once (the engine's `cached` mode); with a shared
memory (`SimMemory.shared`) an adapter is charged its slots while a request holds it.

`SimAdapterCache`: the on-demand mode of bench_queueing's configurations, as gpu_lora/cache.py
and its owner of eviction (server/memory/reclaim.py) run it under a static memory layout: a byte
budget for adapters beside the KV, reference counts, the engine's own eviction policies
(gpu_lora/eviction.py) over the idle adapters (those of waiting requests last) when admission
makes room (`make_room`) before `acquire` allocates, one load at a time over the emulated
link (`SimLink`, the PipelinedLoader's one thread), and a request's prefill only once its
adapter's load has landed.
Without `keep_idle` nothing stays on the device that no request holds (the cache's no-cache
mode: `--adapter-cache off`), and nothing is prefetched. With `stall_for_load` (the
`on-demand-sync` mode) a request starts at once and the step that runs it waits for its load
(`ready_s`): the engine is idle meanwhile.

A simulated request's adapter is its name: it stands in for the engine's `AdapterRef` (which
the gate only passes on and keys on), as a simulation never loads a name twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from toppings.gpu_lora.eviction import Candidate, EvictionPolicy, Usage


class SimAdapters:
    """Every adapter fits: an acquired adapter is charged its slots while it has a reference
    (`SimMemory`); idle ones cost nothing (they are evicted when the room is needed)."""

    def __init__(self, ranks: dict[str, int], slots_per_rank: int):
        self.registry = ranks
        self.refs: dict[str, int] = {}
        # Bytes are memory slots when adapters are charged; else a size proportional to the rank
        # (the queue policy's size of a request) that is never charged.
        self._per_rank = max(slots_per_rank, 1)

    def registered(self) -> list[str]:
        return list(self.registry)

    def make_room(self, name: str, queued: frozenset[str]) -> bool:
        return True  # every adapter fits

    def acquire(self, name: str) -> str:
        self.refs[name] = self.refs.get(name, 0) + 1
        return name

    def release(self, name: str, entry: str) -> None:
        self.refs[name] -= 1

    def serve_on_host(self, name: str) -> None:
        return None  # every adapter fits: admission never asks

    def promote(self, queued) -> None:
        pass

    def may_start(self, entry: str | None) -> bool:
        return True

    def bytes_of(self, name: str | None) -> int:
        return 0 if name is None else self.registry[name] * self._per_rank

    def prefetch(self, names: list[str], queued: frozenset[str]) -> None:
        pass

    def fits_if_released(self, name: str | None, held: str | None) -> bool:
        return False  # an adapter always finds memory: no NO_ADAPTER_MEMORY here

    def next_ready_s(self) -> float | None:
        return None  # no load is ever pending


class SimLink:
    """The emulated link (LinkProfile on the CPU loader thread): loads run one after another,
    each taking its bytes at `gbps` plus `latency_s` (the per-transfer latency of every layer
    group's copy, summed)."""

    def __init__(self, gbps: float, latency_s: float):
        self.bytes_per_s = gbps * 1e9 / 8
        self.latency_s = latency_s
        self.free_s = 0.0  # when the load in flight (the last one queued) lands

    def start(self, num_bytes: int, now: float) -> float:
        """Queue a load of num_bytes at `now`; returns when it lands."""
        self.free_s = max(now, self.free_s) + num_bytes / self.bytes_per_s + self.latency_s
        return self.free_s

    def idle(self, now: float) -> bool:
        return self.free_s <= now


@dataclass
class SimEntry:
    """One adapter on the device or on its way there (what a request's `cache_entry` holds)."""

    name: str
    num_bytes: int
    ready_s: float  # when its load lands
    refcount: int = 0


class SimAdapterCache:
    """On-demand adapters in a byte budget over a link; see the module docstring."""

    def __init__(
        self,
        ranks: dict[str, int],
        bytes_per_rank: int,
        budget_bytes: int,
        link: SimLink,
        policy: EvictionPolicy,
        keep_idle: bool,
        clock: Callable[[], float],
        stall_for_load: bool = False,
    ):
        self.registry = ranks
        self.bytes_per_rank, self.budget_bytes = bytes_per_rank, budget_bytes
        self.link, self.policy, self.keep_idle, self.clock = link, policy, keep_idle, clock
        self.stall_for_load = stall_for_load
        self.entries: dict[str, SimEntry] = {}
        self.usage: dict[str, Usage] = {}
        self.used_bytes = 0
        self.num_loads = self.num_hits = 0

    def registered(self) -> list[str]:
        return list(self.registry)

    def bytes_of(self, name: str | None) -> int:
        return 0 if name is None else self.registry[name] * self.bytes_per_rank

    def make_room(self, name: str, queued: frozenset[str]) -> bool:
        """Evict idle adapters (those `queued` requests want last) until the adapter's load
        fits, as the engine's memory does before its cache allocates; whether it fits."""
        return self._make_room(name, queued, spare_keep=False)

    def acquire(self, name: str) -> SimEntry | None:
        """A reference on the adapter, starting its load on a miss; None: no room until a
        running request ends (`make_room` first: nothing is evicted here)."""
        entry = self.entries.get(name)
        if entry is None:
            entry = self._load(name)
            if entry is None:
                return None
        else:
            self.num_hits += 1
        entry.refcount += 1
        self.usage.setdefault(name, Usage()).touch(self.clock())
        return entry

    def release(self, name: str, entry: SimEntry) -> None:
        self.entries[name].refcount -= 1
        if not self.keep_idle:
            self._drop_idle()

    def serve_on_host(self, name: str) -> None:
        return None  # the simulated modes wait for room (on-demand, on-demand-sync)

    def promote(self, queued) -> None:
        pass

    def may_start(self, entry: SimEntry | None) -> bool:
        """on-demand: a request prefills once its adapter's load has landed (on-demand-sync:
        at once, its step waiting for the load)."""
        return entry is None or self.stall_for_load or entry.ready_s <= self.clock()

    def ready_s(self, entries: list) -> float:
        """When the loads of these entries (SimEntry, a name or None) have all landed."""
        return max((e.ready_s for e in entries if isinstance(e, SimEntry)), default=0.0)

    def prefetch(self, names: list[str], queued: frozenset[str]) -> None:
        """The first adapter of `names` not on the device, when the link is idle and it fits
        by evicting only adapters no request holds or waits for (AdapterManager.prefetch)."""
        if not self.keep_idle or not self.link.idle(self.clock()):
            return
        for name in names:
            if name in self.registry and name not in self.entries:
                if self.bytes_of(name) <= self.budget_bytes:
                    if self._make_room(name, queued, spare_keep=True):
                        self._load(name)
                return

    def fits_if_released(self, name: str | None, held: str | None) -> bool:
        """Whether adapter `name` misses memory now but would fit were the one reference on
        `held` dropped (AdapterManager.fits_if_released)."""
        if name is None or name in self.entries:
            return False
        need = self.bytes_of(name)
        if self._freeable() >= need or held is None or held == name:
            return False
        entry = self.entries.get(held)
        if entry is None or entry.refcount != 1:
            return False
        return self._freeable(extra=held) >= need

    def next_ready_s(self) -> float | None:
        """When the next load in flight lands (None: none is)."""
        now = self.clock()
        pending = [e.ready_s for e in self.entries.values() if e.ready_s > now]
        return min(pending, default=None)

    def _freeable(self, extra: str | None = None) -> int:
        idle = sum(e.num_bytes for n, e in self.entries.items() if not e.refcount or n == extra)
        return self.budget_bytes - self.used_bytes + idle

    def _make_room(self, name: str, keep: frozenset[str], spare_keep: bool) -> bool:
        if not self.keep_idle:
            self._drop_idle(spare=name)
        if name in self.entries or self.bytes_of(name) > self.budget_bytes:
            return True  # a hit needs no room; one too large is refused by `_load`
        while self.used_bytes + self.bytes_of(name) > self.budget_bytes:
            victim = self._victim(keep, spare_keep)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _load(self, name: str) -> SimEntry | None:
        num_bytes = self.bytes_of(name)
        if num_bytes > self.budget_bytes:
            raise ValueError(f"adapter {name!r} needs {num_bytes} bytes; the cache holds "
                             f"{self.budget_bytes}")  # fmt: skip
        if self.used_bytes + num_bytes > self.budget_bytes:
            return None
        now = self.clock()
        entry = SimEntry(name, num_bytes, self.link.start(num_bytes, now))
        self.entries[name] = entry
        self.used_bytes += num_bytes
        self.num_loads += 1
        return entry

    def _victim(self, keep: frozenset[str], spare_keep: bool) -> str | None:
        """The cache's order: idle adapters no waiting request wants first, by the policy."""
        idle = [n for n, e in self.entries.items() if not e.refcount]
        groups = [[n for n in idle if n not in keep], [n for n in idle if n in keep]]
        for group in groups[:1] if spare_keep else groups:
            if group:
                stats = [self._stats(n) for n in group]
                return self.policy.order(stats)[0].name  # the candidates' names
        return None

    def _stats(self, name: str) -> Candidate:
        usage = self.usage.get(name, Usage())
        return Candidate.adapter(name, name, self.entries[name].num_bytes, usage)

    def _evict(self, name: str) -> None:
        self.used_bytes -= self.entries.pop(name).num_bytes

    def _drop_idle(self, spare: str | None = None) -> None:
        now = self.clock()
        for name, entry in list(self.entries.items()):
            if not entry.refcount and name != spare and entry.ready_s <= now:
                self._evict(name)
