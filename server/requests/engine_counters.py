"""The engine's counters and gauges as `/metrics` reads them: typed views, one per owner.

The owners keep their counters as they like (the adapter cache's `snapshot()`, the memory
manager's and the queue policy's `view()` are dicts, because `/stats` sends them as JSON, see
stats_schema's MEMORY and QUEUEING). They cross into the metrics layer here, once, as frozen
dataclasses with named fields, so that a reader's misspelt counter fails at type-check time (or
at the first scrape, as an AttributeError naming the field) rather than as a KeyError on one
rarely taken path. A key an owner does not report (no adapter byte budget, a queue policy
without that counter, KV events off) is None.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


def _known(view: type, body: dict[str, Any]) -> dict[str, Any]:
    """The keys of `body` that are fields of `view` (the others: what this reader ignores)."""
    names = {f.name for f in fields(view)}
    return {k: v for k, v in body.items() if k in names}


@dataclass(frozen=True)
class AdapterCacheView:
    """The device adapter cache (gpu_lora.cache.AdapterCache.snapshot()): counters since start,
    bytes held now and the adapters resident or loading, by name."""

    hits: int = 0
    misses: int = 0
    loads: int = 0
    evictions: int = 0
    compactions: int = 0  # pool packings (rows moved to make room)
    bytes_loaded: int = 0
    used_bytes: int = 0
    budget_bytes: int | None = None  # None: no byte budget
    resident: tuple[str, ...] = ()
    loading: tuple[str, ...] = ()

    @classmethod
    def from_snapshot(cls, snapshot: dict[str, Any]) -> AdapterCacheView:
        known = _known(cls, snapshot)
        for names in ("resident", "loading"):
            known[names] = tuple(known.get(names, ()))
        return cls(**known)


@dataclass(frozen=True)
class BlockCounts:
    """Memory pool blocks by kind at one instant (MEMORY's "blocks")."""

    total: int = 0
    free: int = 0
    kv_in_use: int = 0
    kv_cached: int = 0
    adapters_in_use: int = 0
    adapters_cached: int = 0


@dataclass(frozen=True)
class MemoryView:
    """The memory manager's view (server.memory.manager.MemoryManager.view(), MEMORY in
    stats_schema): its counters since start and its blocks now."""

    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    swaps_in: int = 0
    swaps_out: int = 0
    evictions_kv: int = 0
    evictions_adapter: int = 0
    block_tokens: int | None = None  # None: a view without a block layout
    blocks: BlockCounts = BlockCounts()
    # the KV events stream (None: --kv-events-endpoint off)
    kv_events_batches: int | None = None
    kv_events_dropped: int | None = None
    kv_events_resyncs_asked: int | None = None

    @classmethod
    def from_view(cls, view: dict[str, Any]) -> MemoryView:
        known = _known(cls, view)
        known["blocks"] = BlockCounts(**_known(BlockCounts, known.get("blocks") or {}))
        return cls(**known)


@dataclass(frozen=True)
class QueueView:
    """The queue policy's view (server.sched.queueing.QueuePolicy.view(), QUEUEING in
    stats_schema): per-queue lengths, quotas and cutoffs, and chameleon's counters (None for a
    policy without them)."""

    policy: str = ""
    queue_lengths: tuple[int, ...] = ()
    quotas: tuple[int, ...] | None = None
    cutoffs: tuple[float, ...] | None = None
    bypasses: int | None = None
    squashes: int | None = None
    preemptions: int = 0  # running requests preempted for KV memory (each resumed later)
    reserved: int | None = None  # iterations in which a waiting request held a reservation
    backfilled: int | None = None

    @classmethod
    def from_view(cls, view: dict[str, Any]) -> QueueView:
        known = _known(cls, view)
        for name in ("queue_lengths", "quotas", "cutoffs"):
            if known.get(name) is not None:
                known[name] = tuple(known[name])
        return cls(**known)


@dataclass(frozen=True)
class EngineCounters:
    """The engine's counters (monotonic) and gauges at one instant, read by `/metrics`."""

    finished: dict[str, int]  # requests ended, by finish reason
    prefill_steps: int
    prefill_seconds: float
    decode_steps: int
    decode_seconds: float
    host_lora_calls: int  # CPU LoRA invocations
    host_lora_seconds: float
    num_running: int
    num_waiting: int
    queueing: QueueView
    kv_reserved_tokens: int  # KV token slots promised to admitted requests
    kv_used_tokens: int  # KV token slots holding tokens
    max_total_tokens: int  # KV token slots in all
    memory: MemoryView
    adapter_cache: AdapterCacheView
    adapter_references: int  # references held on device adapters
    # requests served on the host for want of device room (cpu-assisted): admitted so, moved to
    # the device since, and so now (server/adapters/host_served.py)
    host_served: int = 0
    host_promoted: int = 0
    num_host_served: int = 0
    # chunked prefill's tokens per step as the engine resized it last (None: chunked prefill off)
    step_budget_tokens: int | None = None
    # the OpenMP threads the engine's steps run on now, and how often the governor changed it
    # (process/thread_governor.py; None / 0 without it)
    engine_threads: int | None = None
    thread_switches: int = 0
    # the CPU LoRA workers (None without a pool): those alive now, and their restarts (a worker
    # that died or hung is replaced, its slice computed in the server meanwhile)
    cpu_workers_alive: int | None = None
    cpu_worker_restarts: int | None = None
