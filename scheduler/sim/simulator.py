"""Discrete-event simulation of a cluster of LoRA servers routed by a `Policy`.

Each simulated server runs the engine's continuous-batching loop (scheduler/sim/server.py);
iteration durations come from the perf models of the server's kernel. The policy sees what the
real scheduler sees: a snapshot of every server taken every `refresh_s` plus the requests it
routed since. A request reserves KV slots for its prompt and its true output length (the engine
reserves max_new_tokens; a trace has no separate cap). At every snapshot the policy's `tick`
runs with the simulated time and every adapter the cluster knows (`adapters`, default: those of
the trace): that is where `loraserve` re-places.

Adapter memory, two modes (`SimConfig.adapter_store`):
- None (the original model): every adapter is in every server's host memory; nothing is loaded.
- an `AdapterStoreConfig`: each server holds a bounded LRU cache of adapters in host memory
  (scheduler/sim/adapter_pool.py), seeded with adapter i on server i mod S; a request routed to a
  server without its adapter waits for the fetch (from a peer that holds it, else storage)
  before its prefill can start. A policy that places adapters (`Policy.holdings`, loraserve)
  has each server prefetch and pin what it was assigned at every placement. Every server can
  serve every adapter; a policy only decides where the fetch cost is paid.

Prefix caches (`prefix`, scheduler/sim/prefix_cache.py): a conversation's request prefills only
what its server does not hold of its prompt, and `prefix_hit_rate` in the summary is the share
of prompt tokens found cached (the TTFT it saves shows in the TTFT figures).

Metrics per request follow the paper: TTFT, and time per token TPT = end-to-end latency /
output tokens (prefill and queueing included); a request meets the SLO when TPT <= SLO.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from toppings.scheduler.perf_model import PerfModels
from toppings.scheduler.policies import Policy
from toppings.scheduler.sim.adapter_pool import AdapterPool
from toppings.scheduler.sim.prefix_cache import SimPrefixCaches
from toppings.scheduler.sim.server import SimConfig, SimRequest, SimServer
from toppings.scheduler.sim.trace import TraceRequest
from toppings.scheduler.state import RouteRequest, ServerState

__all__ = ["SimConfig", "SimResult", "SimServer", "simulate"]


@dataclass
class SimResult:
    """Finished requests (all of them, warm-up included) and how many were measured.

    adapter_memory: with an adapter store, the pool's counters and each server's host memory
    (see `memory_summary`); empty without one."""

    requests: list[SimRequest]
    measure_from_s: float
    num_unrouted: int = 0
    per_server_requests: list[int] = field(default_factory=list)
    adapter_memory: dict[str, float] = field(default_factory=dict)
    pool: AdapterPool | None = None  # the adapter store's final state, when there is one

    def measured(self) -> list[SimRequest]:
        return [r for r in self.requests if r.trace.arrival_s >= self.measure_from_s]

    def tpt_ms(self) -> list[float]:
        return [
            (r.finish_s - r.trace.arrival_s) * 1000.0 / r.trace.output_tokens
            for r in self.measured()
        ]

    def summary(self, slo_tpt_ms: float) -> dict[str, float]:
        measured = self.measured()
        tpt = sorted(self.tpt_ms())
        ttft = sorted((r.first_token_s - r.trace.arrival_s) * 1000.0 for r in measured)
        num = len(tpt)
        if num == 0:
            return {"num_measured": 0}
        out = {
            "num_measured": num,
            "slo_attainment": sum(1 for t in tpt if t <= slo_tpt_ms) / num,
            "mean_tpt_ms": sum(tpt) / num,
            "p50_tpt_ms": tpt[num // 2],
            "p99_tpt_ms": tpt[min(num - 1, int(0.99 * num))],
            "mean_ttft_ms": sum(ttft) / num,
            "p99_ttft_ms": ttft[min(num - 1, int(0.99 * num))],
            "num_unrouted": self.num_unrouted,
        }
        prompt = sum(r.trace.prompt_tokens for r in measured)
        if any(r.trace.prefix_id >= 0 for r in measured):
            out["prefix_hit_rate"] = sum(r.cached_tokens for r in measured) / prompt
        if self.adapter_memory:
            waits = [r.fetch_wait_s * 1000.0 for r in measured if r.fetch_wait_s > 0]
            out["fraction_waited_for_adapter"] = len(waits) / num
            out["mean_adapter_wait_ms"] = sum(waits) / len(waits) if waits else 0.0
            out["adapter_memory"] = self.adapter_memory
        return out


def memory_summary(pool: AdapterPool) -> dict[str, float]:
    """The pool's counters and host memory per server (peak bytes, adapters held at the end)."""
    held = [len(c.entries) for c in pool.caches]
    peaks = [c.peak for c in pool.caches]
    return {
        "host_bytes_capacity": pool.config.host_bytes,
        "host_bytes_peak_mean": sum(peaks) / len(peaks),
        "host_bytes_peak_max": max(peaks),
        "adapters_held_mean": sum(held) / len(held),
        "adapters_held_max": max(held),
        "hits": pool.hits,
        "peer_fetches": pool.peer_fetches,
        "storage_fetches": pool.storage_fetches,
        "prefetches": pool.prefetches,
    }


def simulate(
    trace: Sequence[TraceRequest],
    policy: Policy,
    perf: PerfModels,
    config: SimConfig,
    adapters: Mapping[str, int] | None = None,
    prefix: SimPrefixCaches | None = None,
) -> SimResult:
    """Run `trace` through `config.num_servers` servers routed by `policy` until all finish.

    adapters: every adapter of the cluster (name -> rank) for the policy's `tick`; prefix: the
    servers' prefix caches (scheduler/sim/prefix_cache.py; a prefix-aware policy is built on
    the same object), None: no request finds any of its prompt cached.
    """
    if adapters is None:
        adapters = {r.adapter: r.rank for r in trace}
    known = frozenset(adapters) | frozenset(r.adapter for r in trace)
    servers = [SimServer(i, config, perf, known, prefix) for i in range(config.num_servers)]
    pool = None
    if config.adapter_store is not None:
        pool = AdapterPool(config.num_servers, config.adapter_store)
        pool.seed(adapters)
    run = _Run(policy, config, adapters, servers, pool, prefix)
    arrival_idx = 0
    while arrival_idx < len(trace) or run.events or run.fetches:
        t_arrival = trace[arrival_idx].arrival_s if arrival_idx < len(trace) else math.inf
        t_event = run.events[0][0] if run.events else math.inf
        t_fetch = run.fetches[0][0] if run.fetches else math.inf
        if t_arrival <= t_event and t_arrival <= t_fetch:
            run.arrive(trace[arrival_idx])
            arrival_idx += 1
        elif t_fetch <= t_event:
            run.fetched()
        else:
            run.iterate()
    duration = trace[-1].arrival_s if trace else 0.0
    memory = memory_summary(pool) if pool is not None else {}
    return SimResult(
        run.done, config.warmup_fraction * duration, run.num_unrouted, run.per_server, memory, pool
    )


class _Run:
    """One simulation's moving parts: the servers, the two event heaps (iterations, adapter
    fetches) and what the policy sees of the servers between snapshots."""

    def __init__(
        self,
        policy: Policy,
        config: SimConfig,
        adapters: Mapping[str, int],
        servers: list[SimServer],
        pool: AdapterPool | None,
        prefix: SimPrefixCaches | None,
    ) -> None:
        self.policy, self.config, self.adapters = policy, config, adapters
        self.servers, self.pool, self.prefix = servers, pool, prefix
        self.by_url = {s.state().url: s.idx for s in servers}
        self.holdings_version: int | None = None
        # (time, server idx, is_end): an iteration ends, or an idle server starts one. A start
        # is an event at the arrival time, not an immediate call, so that requests arriving at
        # the same instant share one prefill.
        self.events: list[tuple[float, int, bool]] = []
        # (adapter in host memory, request idx, server idx, request)
        self.fetches: list[tuple[float, int, int, SimRequest]] = []
        self.done: list[SimRequest] = []
        self.per_server = [0] * config.num_servers
        self.num_unrouted = 0
        self.views: list[ServerState] = []
        self.next_refresh_s = -math.inf

    def arrive(self, item: TraceRequest) -> None:
        """Route one arrival (after a snapshot when one is due) and queue it on its server, or
        behind its adapter's fetch."""
        now = item.arrival_s
        if now >= self.next_refresh_s:
            self._snapshot(now)
        key = self.prefix.key(item) if self.prefix is not None else None
        route = RouteRequest(item.adapter, item.rank, item.prompt_tokens, item.output_tokens,
                             prefix=key)  # fmt: skip
        target = self.policy.choose(route, self.views)
        if target is None:
            self.num_unrouted += 1
            return
        self.views[target] = self.views[target].with_routed(
            item.rank, item.prompt_tokens, item.output_tokens
        )
        self.per_server[target] += 1
        request = SimRequest(item)
        ready = now
        if self.pool is not None and item.rank > 0:  # rank 0: the base model, no adapter
            ready = self.pool.acquire(target, item.adapter, item.rank, now)
        if ready > now:
            request.fetch_wait_s = ready - now
            self.servers[target].enqueue(request, fetching=True)
            heapq.heappush(self.fetches, (ready, item.idx, target, request))
            return
        self.servers[target].enqueue(request)
        self._wake(now, target)

    def fetched(self) -> None:
        """The earliest adapter fetch ends: its request may run."""
        now, _, target, request = heapq.heappop(self.fetches)
        self.servers[target].release(request)
        self._wake(now, target)

    def iterate(self) -> None:
        """The earliest iteration event: finish the server's iteration, start its next."""
        now, target, is_end = heapq.heappop(self.events)
        server = self.servers[target]
        if is_end:
            server.finish_iteration(now, self.done)
        end = server.start_iteration(now)
        if end is not None:
            heapq.heappush(self.events, (end, target, True))

    def _snapshot(self, now: float) -> None:
        """What the real scheduler's /stats poll gives the policy, and its tick."""
        self.views = [s.state() for s in self.servers]
        self.policy.tick(now, self.views, self.adapters)
        if self.pool is not None:
            self.holdings_version = _prefetch(
                self.policy, self.pool, self.by_url, self.adapters, self.holdings_version, now
            )
        refresh_s = self.config.refresh_s
        self.next_refresh_s = (
            now if refresh_s == 0 else (math.floor(now / refresh_s) + 1) * refresh_s
        )

    def _wake(self, now: float, target: int) -> None:
        """An idle server starts an iteration at `now`."""
        server = self.servers[target]
        if not server.busy:
            server.busy = True
            heapq.heappush(self.events, (now, target, False))


def _prefetch(
    policy: Policy,
    pool: AdapterPool,
    by_url: Mapping[str, int],
    ranks: Mapping[str, int],
    version: int | None,
    now: float,
) -> int | None:
    """After a tick: when the policy published new holdings, every server prefetches and pins
    what it was assigned (and unpins the rest). Returns the holdings version now applied."""
    held = policy.holdings()
    if held is None or held[0] == version:
        return version
    for url, idx in by_url.items():
        names = held[1].get(url, ())
        pool.assign(idx, {a: ranks[a] for a in names if a in ranks}, now)
    return held[0]
