"""Device adapter cache: a byte budget over the adapter pool, reference counts, loads.

Adapters are keyed by id (`LoraAdapter.id`: the registration's `AdapterRef.id` in a server),
never by name: an adapter unloaded and loaded again under its name is another adapter, and
rows still cached for the first can never be taken for the second.

The cache never decides what leaves the device: the node's one owner of eviction (the server
memory's reclaimer, which holds the `Eviction` table of gpu_lora/eviction.py) makes room first,
asking `has_room` and evicting the cache's `candidates` through `evict`; `acquire` then only
allocates. `acquire` is called when a request is admitted: a hit takes a reference; a miss
takes pool rows and starts a pipelined load, whose ticket tells which layers are resident, or
returns None when the room is not there. Allocation and eviction stay apart so that two
deciders never call into each other. An adapter with a reference is never evicted. Each
adapter is charged what it occupies in the pool (`AdapterPool.bytes_for`: its rank's rows in
every layer of each projection it targets, at the pool's dtype), before anything is allocated;
the pool's tensors never outgrow the budget, nor the whole `memory` when there is one. With a
`memory` (an `AdapterBudget`: the server's one memory pool) each load also takes its charge
there, from blocks already free, and an eviction gives it back. The memory pool reads the
cache only through its public views (`candidates`, `idle_candidates`, `is_pinned`, `pinned`,
`referenced`, `frequencies`).

With `keep_idle` False the cache keeps nothing (S-LoRA's on-demand loading, the baseline of
Chameleon's comparison): an adapter leaves the device as soon as no request holds it, once its
load has landed (one still loading leaves at the next `drop_idle` or release, so the engine
thread never waits for a copy), and nothing is prefetched, which would only load an adapter to
drop it. That is no eviction (no order is asked): without a cache nothing idle is kept.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from toppings.gpu_lora.adapter_pool import AdapterPool, ResidentAdapter
from toppings.gpu_lora.eviction import Candidate, Usage
from toppings.gpu_lora.loader import LoadTicket, PipelinedLoader
from toppings.gpu_lora.peft.adapter import LoraAdapter

log = logging.getLogger(__name__)


@dataclass
class CacheEntry:
    """One adapter on the device (or on its way there)."""

    resident: ResidentAdapter
    ticket: LoadTicket
    num_bytes: int
    refcount: int = 0


@dataclass
class CacheCounters:
    hits: int = 0
    misses: int = 0
    loads: int = 0
    evictions: int = 0
    bytes_loaded: int = 0
    compactions: int = 0  # the pool's rows packed to make room for a load


class EntryState(NamedTuple):
    """Where one cache entry stands: every layer on the device, or its load still running (a
    failed load is neither), and whether it cannot leave the device now (`is_pinned`)."""

    name: str
    on_device: bool
    loading: bool
    pinned: bool


class AdapterBudget(Protocol):
    """The memory adapters are charged to beside the cache's own byte budget."""

    def take(self, adapter_id: int, num_bytes: int, promised: bool) -> bool:
        """Charge `num_bytes` for the adapter of this id from what is free now (nothing is
        evicted here: room was made before); `promised`: a request's load, which admission
        counted, rather than a prefetch. False when the room is not there."""
        ...

    def give(self, adapter_id: int) -> None:
        """The adapter of this id left the device: its charge is free again."""
        ...

    def capacity_bytes(self) -> int:
        """The most bytes adapters could be charged in all (the memory when it is empty)."""
        ...


class AdapterCache:
    """Which adapters are on the device; see the module docstring."""

    def __init__(
        self,
        pool: AdapterPool,
        loader: PipelinedLoader,
        budget_bytes: int | None = None,
        memory: AdapterBudget | None = None,
        keep_idle: bool = True,
    ):
        self.pool = pool
        self.loader = loader
        self.budget_bytes = budget_bytes
        self.memory = memory  # None: the byte budget above is the only limit
        self.keep_idle = keep_idle  # False: no cache (see the module docstring)
        self.entries: dict[int, CacheEntry] = {}  # by adapter id (`LoraAdapter.id`)
        self.counters = CacheCounters()
        self._usage: dict[int, Usage] = {}
        self._used_bytes = 0
        # The pool's tensors never hold more than the most adapters can be charged.
        self.max_pool_bytes = self.max_adapter_bytes()

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def charge(self, adapter: LoraAdapter) -> int:
        """Bytes the adapter is charged while on the device (what it occupies in the pool)."""
        return self.pool.charge(adapter)

    def max_adapter_bytes(self) -> int | None:
        """The largest charge one adapter can ever get room for (None: no limit)."""
        limits = [self.budget_bytes] if self.budget_bytes is not None else []
        if self.memory is not None:
            limits.append(self.memory.capacity_bytes())
        return min(limits, default=None)

    def acquire(self, adapter: LoraAdapter, promised: bool = True) -> CacheEntry | None:
        """Take a reference on `adapter`, loading it if needed; None when the room for its load
        is not there (the owner of eviction makes room before: nothing is evicted here). Raises
        ValueError when it is larger than the cache's whole budget. promised: a load admission
        counted (False: one that takes only memory no admitted request was promised, as a
        prefetch; `AdapterBudget.take`)."""
        usage = self._usage.setdefault(adapter.id, Usage())
        entry = self.entries.get(adapter.id)
        if entry is not None and entry.ticket.error is not None and not entry.refcount:
            entry.ticket = self.loader.submit(adapter, entry.resident)  # failed: load it again
            self.counters.loads += 1
            self.counters.bytes_loaded += entry.num_bytes
            self.counters.misses += 1
        elif entry is not None:
            self.counters.hits += 1
        else:
            entry = self._load(adapter, promised)
            if entry is None:
                return None
            self.counters.misses += 1
        entry.refcount += 1
        usage.touch(time.monotonic())
        return entry

    def release(self, adapter_id: int) -> None:
        """Drop a reference taken by `acquire` on the adapter of this id."""
        entry = self.entries[adapter_id]
        if entry.refcount <= 0:
            raise RuntimeError(f"adapter {entry.resident.name!r} released more often than acquired")
        entry.refcount -= 1
        if not self.keep_idle:
            self.drop_idle()

    def drop_idle(self, spare: int | None = None) -> None:
        """Without a cache (`keep_idle` False): drop every adapter no request holds whose load
        has landed (but the one of id `spare`, about to be acquired); with one, nothing."""
        if self.keep_idle:
            return
        for adapter_id, entry in list(self.entries.items()):
            if not entry.refcount and adapter_id != spare and _landed(entry):
                self.evict(adapter_id)

    def evict(self, adapter_id: int) -> None:
        """Drop an unreferenced adapter from the device: the owner of eviction's choice, an
        unload, or no cache's release (see the module docstring)."""
        entry = self.entries[adapter_id]
        if entry.refcount:
            raise RuntimeError(f"adapter {entry.resident.name!r} is in use "
                               f"({entry.refcount} references)")  # fmt: skip
        if not entry.ticket.done:
            entry.ticket.wait()  # rows being written cannot be handed to another adapter yet
        del self.entries[adapter_id]
        self.pool.remove(adapter_id)
        self._used_bytes -= entry.num_bytes
        self.counters.evictions += 1
        if self.memory is not None:
            self.memory.give(adapter_id)

    def rename(self, adapter_id: int, name: str) -> None:
        """The adapter of this id goes by `name` now (AdapterPool.rename), if it is here."""
        entry = self.entries.get(adapter_id)
        if entry is not None:
            entry.resident = self.pool.rename(adapter_id, name)

    def forget(self, adapter_id: int) -> None:
        """An adapter was unregistered: drop it from the device and its usage history."""
        if adapter_id in self.entries:
            self.evict(adapter_id)
        self._usage.pop(adapter_id, None)

    def prefetch(self, adapter: LoraAdapter) -> bool:
        """Start loading the adapter of a queued request, taking no reference, where the room is
        there now (made by the owner of eviction, sparing adapters in use or wanted); False
        when it is not, or without a cache."""
        if adapter.id in self.entries or not self.keep_idle or not self.can_ever_hold(adapter):
            return False
        self._usage.setdefault(adapter.id, Usage())
        return self._load(adapter, promised=False) is not None

    def freeable_bytes(self, extra: int | None = None) -> float:
        """Bytes a load could have now: free budget plus unreferenced adapters (inf without a
        budget); `extra`: count the adapter of that id as unreferenced too."""
        if self.budget_bytes is None:
            return float("inf")
        idle = sum(
            e.num_bytes for n, e in list(self.entries.items()) if e.refcount == 0 or n == extra
        )
        return self.budget_bytes - self._used_bytes + idle

    def can_ever_hold(self, adapter: LoraAdapter) -> bool:
        """Whether the adapter's charge is within the cache's whole budget."""
        return self.budget_bytes is None or self.charge(adapter) <= self.budget_bytes

    def has_room(self, adapter: LoraAdapter) -> bool:
        """Whether a load of the adapter fits the cache's own limits now: its byte budget, and
        rows in the pool without outgrowing max_pool_bytes (packing the rows when the bytes are
        there but no row range is: moving rows evicts nothing). The memory it is charged to is
        not asked here. True for an adapter already here."""
        if adapter.id in self.entries:
            return True
        if not self._within_budget(self.charge(adapter)):
            return False
        if self.pool.can_reserve(adapter, self.max_pool_bytes):
            return True
        return self._compact() and self.pool.can_reserve(adapter, self.max_pool_bytes)

    def waits_for_loader(self, adapter: LoraAdapter) -> bool:
        """Whether the pool must reallocate its tensors for the adapter's rows, which cannot
        happen under a running load: it is not loaded until the loader is idle."""
        return self.pool.must_grow(adapter, self.max_pool_bytes) and not self.loader.idle()

    def _load(self, adapter: LoraAdapter, promised: bool) -> CacheEntry | None:
        num_bytes = self.charge(adapter)
        if not self.can_ever_hold(adapter):
            raise ValueError(
                f"adapter {adapter.name!r} needs {num_bytes} bytes; the cache holds "
                f"{self.budget_bytes}"
            )
        if not self.has_room(adapter):
            return None
        if self.waits_for_loader(adapter):
            return None
        if self.memory is not None and not self.memory.take(adapter.id, num_bytes, promised):
            return None
        resident = self.pool.reserve(adapter, self.max_pool_bytes)
        ticket = self.loader.submit(adapter, resident)
        entry = CacheEntry(resident, ticket, num_bytes)
        self.entries[adapter.id] = entry
        self._used_bytes += num_bytes
        self.counters.loads += 1
        self.counters.bytes_loaded += num_bytes
        return entry

    def _within_budget(self, num_bytes: int) -> bool:
        return self.budget_bytes is None or self._used_bytes + num_bytes <= self.budget_bytes

    def _compact(self) -> bool:
        """Pack the pool's rows (adapters whose load is running stay where it writes); whether
        any adapter moved. Without it a budget with room in bytes could hold a request back
        until an adapter in the middle of the rows ended."""
        loading = frozenset(n for n, e in self.entries.items() if not e.ticket.done)
        moved = self.pool.compact(loading)
        for adapter_id, resident in moved.items():
            self.entries[adapter_id].resident = resident
        self.counters.compactions += bool(moved)
        return bool(moved)

    # ---- read-only views (the memory pool's, and /stats') ---------------------------------

    def usage(self, adapter_id: int) -> Usage:
        """When the adapter was last used and by how many requests (a copy)."""
        usage = self._usage.get(adapter_id, Usage())
        return Usage(usage.last_used, usage.frequency)

    def frequencies(self) -> dict[int, int]:
        """Requests per adapter id since it was registered, resident or not."""
        return {n: u.frequency for n, u in list(self._usage.items())}

    @property
    def num_entries(self) -> int:
        """Adapters on the device or on their way there."""
        return len(self.entries)

    def holds(self, adapter_id: int) -> bool:
        """Whether the adapter is on the device or on its way there."""
        return adapter_id in self.entries

    def referenced(self) -> list[int]:
        """Ids of the adapters a request holds, in cache order (one copy of the entries: any
        thread)."""
        return [n for n, e in list(self.entries.items()) if e.refcount]

    def is_pinned(self, adapter_id: int) -> bool:
        """Whether the adapter cannot leave the device now: a request holds it, or its load
        (a prefetch's, or one whose request let go) is still running."""
        entry = self.entries.get(adapter_id)
        return entry is not None and _pinned(entry)

    def pinned(self) -> list[int]:
        """Ids of the adapters that cannot leave the device now (`is_pinned`), in cache order."""
        return [n for n, e in list(self.entries.items()) if _pinned(e)]

    def entry_states(self) -> dict[int, EntryState]:
        """Each adapter on the device or on its way there, by id, in cache order (one copy of
        the entries: any thread)."""
        states = {}
        for n, e in list(self.entries.items()):
            done = e.ticket.done
            states[n] = EntryState(e.resident.name, done, not done and e.ticket.error is None,
                                   _pinned(e))  # fmt: skip
        return states

    def _candidate(self, adapter_id: int) -> Candidate:
        entry = self.entries[adapter_id]
        return Candidate.adapter(adapter_id, entry.resident.name, entry.num_bytes,
                                 self.usage(adapter_id), entry.resident.rank)  # fmt: skip

    def candidates(self) -> list[Candidate]:
        """Adapters no request holds, in cache order, as eviction candidates: what may leave to
        make room for another adapter in the cache's own limits (`has_room`; one still loading
        too: evicting it waits for its copy)."""
        return [self._candidate(n) for n, e in list(self.entries.items()) if not e.refcount]

    def idle_candidates(self) -> list[Candidate]:
        """Loaded adapters no request holds, in cache order, as eviction candidates: what may
        leave for other memory (one whose load failed too)."""
        return [self._candidate(n) for n, e in list(self.entries.items())
                if not e.refcount and _landed(e)]  # fmt: skip

    def snapshot(self) -> dict:
        """Counters and lists for /stats and /metrics (safe from other threads: one list copy)."""
        entries = list(self.entries.items())
        return {
            "used_bytes": self._used_bytes,
            "budget_bytes": self.budget_bytes,
            "resident": [e.resident.name for _, e in entries if e.ticket.done],
            "loading": [e.resident.name for _, e in entries if not e.ticket.done],
            **vars(self.counters),
        }


def _landed(entry: CacheEntry) -> bool:
    """Whether the entry's load has ended: every layer resident, or the load failed."""
    return entry.ticket.done or entry.ticket.error is not None


def _pinned(entry: CacheEntry) -> bool:
    """Whether the entry cannot leave the device now: held by a request, or its load running."""
    return entry.refcount > 0 or not _landed(entry)
