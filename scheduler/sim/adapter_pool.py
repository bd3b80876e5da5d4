"""Host memory for adapters in the simulated cluster: a bounded LRU cache per server, and what a
miss costs.

Every policy runs on the same per-server resources (`AdapterStoreConfig`):
- a host-memory adapter cache of `host_bytes` per server, least recently used out first;
- a miss fetches the adapter's bytes: from a peer's host memory over the interconnect when some
  server holds a complete copy (LoRAServe's distributed pool: a GPUDirect RDMA transfer over
  InfiniBand), else from storage (the node's local disk). A fetch costs a fixed latency plus
  bytes / bandwidth; a server's fetches share its link and run one after another (FIFO), a
  request's fetch ahead of any placement prefetch (strict priority; the two lanes are timed
  apart, so prefetch traffic never delays a request, and a prefetch is not slowed by the
  requests' fetches, which move far fewer bytes). A copy still in flight to another server
  counts as held (the fetch would wait for it anyway);
- the GPU-side load (host -> device) is not charged: every policy runs Toppings' cpu-assisted
  mode, where the first token proceeds while the adapter's layers load, the CPU computing their
  LoRA deltas meanwhile; the load of the largest adapter modelled (rank 64, ~100 MB) over a
  PCIe 4.0 x16 link (~25 GB/s) is ~4 ms, against a ~60 ms time-per-token SLO.

Adapters a placement assigns to a server (`assign`) are prefetched at once, queued on the
server's link, and pinned: the LRU evicts them only when the pinned set alone overflows the
cache. Unassigned ones stay as ordinary cache entries (a later hit costs nothing) until evicted.
A request for an adapter still in flight waits for that transfer, unless it is a prefetch that a
request's fetch, started now on the request lane, would beat.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

GIB = 1 << 30
# Llama-7B, LoRA on q/k/v (the LoRAServe paper's setting), fp16:
# 32 layers x 3 projections x (A: 4096 x R + B: R x 4096) x 2 bytes = R x 1.5 MiB
BYTES_PER_RANK = 32 * 3 * 2 * 4096 * 2


@dataclass(frozen=True)
class AdapterStoreConfig:
    """Per-server adapter memory and the two fetch paths (bandwidths in GB/s = 1e9 bytes/s).

    Defaults, all assumptions taken from the hardware the LoRAServe paper ran on (Azure
    ND96asr_v4: 8 A100s, 900 GiB host memory, 8 x 200 Gb/s HDR InfiniBand, local NVMe):
    host_bytes 64 GiB: a bit over half of a GPU's 112.5 GiB share of the node's host memory; the
    rest holds the base model's host copy, the cpu-assisted workers and KV/prefix swap space.
    peer: one 200 Gb/s HDR link per GPU = 25 GB/s; 0.5 ms per transfer for the control message
    and the peer's host -> GPU staging (the paper: "similar latency as ... local memory to GPU").
    storage: 1 GB/s and 1 ms: a node's NVMe array (~8 GB/s sequential) shared by its 8 servers.
    """

    host_bytes: int = 64 * GIB
    bytes_per_rank: int = BYTES_PER_RANK
    peer_gbps: float = 25.0
    peer_latency_s: float = 0.5e-3
    storage_gbps: float = 1.0
    storage_latency_s: float = 1e-3

    def __post_init__(self) -> None:
        if self.host_bytes < 0 or self.bytes_per_rank <= 0:
            raise ValueError("host_bytes must be >= 0 and bytes_per_rank positive")
        if min(self.peer_gbps, self.storage_gbps) <= 0:
            raise ValueError("bandwidths must be positive")
        if min(self.peer_latency_s, self.storage_latency_s) < 0:
            raise ValueError("latencies must be >= 0")

    def size(self, rank: int) -> int:
        return max(1, rank) * self.bytes_per_rank


class HostCache:
    """One server's adapters in host memory: name -> bytes, least recently used first.

    `pinned` names are evicted only when nothing else is left to evict.
    """

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.entries: OrderedDict[str, int] = OrderedDict()
        self.pinned: set[str] = set()
        self.used = 0
        self.peak = 0

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def touch(self, name: str) -> None:
        self.entries.move_to_end(name)

    def insert(self, name: str, size: int) -> list[str]:
        """Add `name` (most recent) and evict LRU entries until it fits; returns the evicted.

        An adapter larger than the whole cache is not kept (it serves the one request)."""
        if name in self.entries:
            self.touch(name)
            return []
        if size > self.capacity:
            return []
        evicted = []
        while self.used + size > self.capacity:
            victim = next((n for n in self.entries if n not in self.pinned), None)
            if victim is None:
                victim = next(iter(self.entries))
            self.used -= self.entries.pop(victim)
            self.pinned.discard(victim)
            evicted.append(victim)
        self.entries[name] = size
        self.used += size
        self.peak = max(self.peak, self.used)
        return evicted


class AdapterPool:
    """Every server's `HostCache`, who holds what, and each server's fetch link.

    `acquire(server, adapter, rank, now)` returns when the adapter is in that server's host
    memory (now on a hit). Counters: hits, peer_fetches, storage_fetches (requests' and
    prefetches' transfers), prefetches.
    """

    def __init__(self, num_servers: int, config: AdapterStoreConfig):
        self.config = config
        self.caches = [HostCache(config.host_bytes) for _ in range(num_servers)]
        self.ready_s: list[dict[str, float]] = [{} for _ in range(num_servers)]  # in flight
        self.link_free_s = [0.0] * num_servers  # requests' fetches
        self.prefetch_free_s = [0.0] * num_servers  # placement prefetches
        self.holders: dict[str, int] = {}  # adapter -> servers with it in host memory
        self.hits = self.peer_fetches = self.storage_fetches = self.prefetches = 0

    def seed(self, ranks: Mapping[str, int]) -> None:
        """Initial host memory, before any request: adapter i of `ranks` on server i mod S (every
        adapter somewhere while the cluster's memory allows), ready at time 0."""
        for i, (name, rank) in enumerate(ranks.items()):
            self._insert(i % len(self.caches), name, self.config.size(rank))

    def acquire(self, server: int, adapter: str, rank: int, now: float) -> float:
        """Time at which `adapter` is in `server`'s host memory for a request arriving `now`."""
        cache = self.caches[server]
        if adapter not in cache:
            return self._fetch(server, adapter, rank, now)
        cache.touch(adapter)
        ready = self.ready_s[server].get(adapter, 0.0)
        if ready <= now:
            self.hits += 1
            return now
        # still in flight: a prefetch queued behind others is overtaken by a request's fetch
        size = self.config.size(rank)
        direct = max(now, self.link_free_s[server]) + size / (self.config.peer_gbps * 1e9)
        if direct + self.config.peer_latency_s >= ready:
            return ready
        self.link_free_s[server] = direct
        self.ready_s[server][adapter] = ready = direct + self.config.peer_latency_s
        self.peer_fetches += 1
        return ready

    def assign(self, server: int, adapters: Mapping[str, int], now: float) -> None:
        """A placement gave `server` these adapters (name -> rank): pin them, prefetching the
        ones it lacks; the ones it held before and no longer has become evictable."""
        cache = self.caches[server]
        cache.pinned = {name for name in adapters if name in cache}
        for name, rank in adapters.items():
            if name not in cache:
                self._fetch(server, name, rank, now, prefetch=True)
                self.prefetches += 1
                cache.pinned.add(name)

    def held(self, server: int) -> Iterable[str]:
        return self.caches[server].entries.keys()

    def _fetch(self, server: int, adapter: str, rank: int, now: float, prefetch: bool = False):
        """Start a transfer to `server`; returns when it completes. Two FIFO lanes per link:
        a request's fetch preempts prefetches (strict priority), so the lanes are timed apart;
        a request for an adapter still queued for prefetch takes the earlier of the two."""
        cfg = self.config
        size = cfg.size(rank)
        if self.holders.get(adapter, 0) > 0:
            gbps, latency = cfg.peer_gbps, cfg.peer_latency_s
            self.peer_fetches += 1
        else:
            gbps, latency = cfg.storage_gbps, cfg.storage_latency_s
            self.storage_fetches += 1
        lane = self.prefetch_free_s if prefetch else self.link_free_s
        lane[server] = max(now, lane[server]) + size / (gbps * 1e9)
        ready = lane[server] + latency
        self._insert(server, adapter, size)
        if adapter in self.caches[server]:
            self.ready_s[server][adapter] = ready
        return ready

    def _insert(self, server: int, adapter: str, size: int) -> None:
        if adapter in self.caches[server]:
            return
        for victim in self.caches[server].insert(adapter, size):
            self.ready_s[server].pop(victim, None)
            self.holders[victim] -= 1
        if adapter in self.caches[server]:
            self.holders[adapter] = self.holders.get(adapter, 0) + 1
