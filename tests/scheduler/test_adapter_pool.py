"""Adapter host memory in the simulator: LRU within bytes, what a miss costs, prefetch and pins."""

from __future__ import annotations

import pytest

from toppings.scheduler.loraserve import PlacementConfig
from toppings.scheduler.paper_models import paper_fig6_models
from toppings.scheduler.policies import make_policy
from toppings.scheduler.sim.adapter_pool import AdapterPool, AdapterStoreConfig, HostCache
from toppings.scheduler.sim.simulator import SimConfig, simulate
from toppings.scheduler.sim.trace import TraceConfig, TraceRequest, generate_trace
from toppings.scheduler.state import BatchShape

PERF = paper_fig6_models()
MB = 1_000_000
# 1 MB per rank unit, 1 GB/s from a peer (1 ms per MB), 0.1 GB/s from storage
STORE = AdapterStoreConfig(
    host_bytes=100 * MB,
    bytes_per_rank=MB,
    peer_gbps=1.0,
    peer_latency_s=0.002,
    storage_gbps=0.1,
    storage_latency_s=0.005,
)


def test_cache_evicts_least_recently_used_within_its_bytes():
    cache = HostCache(100)
    assert cache.insert("a", 40) == [] and cache.insert("b", 40) == []
    cache.touch("a")
    assert cache.insert("c", 40) == ["b"]  # b is the least recently used
    assert set(cache.entries) == {"a", "c"} and cache.used == 80 <= cache.capacity
    assert cache.insert("huge", 101) == [] and "huge" not in cache  # never fits: not kept


def test_pinned_entries_go_last():
    cache = HostCache(100)
    for name in "abc":
        cache.insert(name, 30)
    cache.pinned = {"a", "b"}
    assert cache.insert("d", 30) == ["c"]  # the only unpinned one, though a is older
    cache.pinned.add("d")
    assert cache.insert("e", 30) == ["a"]  # nothing else left: the pinned LRU goes


def test_a_hit_is_free_and_a_miss_costs_the_fetch_from_a_peer_else_storage():
    pool = AdapterPool(2, STORE)
    pool.seed({"x": 8, "y": 16})  # x on server 0, y on server 1
    assert pool.acquire(0, "x", 8, now=1.0) == 1.0 and pool.hits == 1
    # y is on server 1: server 0 fetches its 16 MB from the peer, 16 ms + 2 ms
    assert pool.acquire(0, "y", 16, now=1.0) == pytest.approx(1.018)
    # nobody holds z: 10 MB from storage at 0.1 GB/s = 100 ms + 5 ms
    assert pool.acquire(1, "z", 10, now=2.0) == pytest.approx(2.105)
    assert (pool.peer_fetches, pool.storage_fetches) == (1, 1)
    # a second request while y is in flight waits for the same transfer; later it is a hit
    assert pool.acquire(0, "y", 16, now=1.010) == pytest.approx(1.018)
    assert pool.acquire(0, "y", 16, now=1.5) == 1.5 and pool.peer_fetches == 1


def test_fetches_to_one_server_queue_on_its_link():
    pool = AdapterPool(2, STORE)
    pool.seed({"p": 1, "a": 10, "q": 1, "b": 10})  # a and b on server 1
    first = pool.acquire(0, "a", 10, now=0.0)
    second = pool.acquire(0, "b", 10, now=0.0)
    assert first == pytest.approx(0.012) and second == pytest.approx(0.022)


def test_assigned_adapters_are_prefetched_pinned_and_resident():
    pool = AdapterPool(2, STORE)
    pool.seed({f"a{i}": 10 for i in range(8)})  # 4 x 10 MB on each server
    pool.assign(0, {"a1": 10, "a3": 10}, now=0.0)  # held by server 1: prefetched from it
    assert pool.prefetches == 2 and pool.caches[0].pinned == {"a1", "a3"}
    assert pool.acquire(0, "a1", 10, now=1.0) == 1.0  # arrived long ago: a hit
    for i in range(9):  # fill server 0 with 90 MB of other adapters
        pool.acquire(0, f"b{i}", 10, now=2.0)
    assert {"a1", "a3"} <= set(pool.held(0))  # pinned: survived the pressure
    assert pool.caches[0].used <= STORE.host_bytes
    pool.assign(0, {}, now=3.0)  # no longer assigned: evictable again
    for i in range(9, 20):
        pool.acquire(0, f"b{i}", 10, now=4.0)
    assert "a1" not in set(pool.held(0))


def test_a_request_waits_for_its_adapter_before_prefill():
    # server 1 holds "far" (seeded i mod 2); random routing seeded so the request lands on 0
    request = TraceRequest(0, 1.0, "far", 32, prompt_tokens=100, output_tokens=5)
    universe = {"near": 32, "far": 32}
    prefill_ms = PERF.prefill("bgmv").predict(BatchShape.of([32], [100]))
    fetch_s = 32 * MB / 1e9 + STORE.peer_latency_s
    for seed in range(20):
        policy = make_policy("random", PERF, 50.0, seed=seed)
        result = simulate([request], policy, PERF, SimConfig(2, adapter_store=STORE), universe)
        on = result.per_server_requests.index(1)
        (done,) = result.requests
        wait = fetch_s if on == 0 else 0.0
        assert done.fetch_wait_s == pytest.approx(wait)
        assert done.first_token_s == pytest.approx(1.0 + wait + prefill_ms / 1000)
    plain = simulate([request], make_policy("random", PERF, 50.0), PERF, SimConfig(2), universe)
    assert plain.pool is None and plain.requests[0].fetch_wait_s == 0.0


def test_loraserve_servers_hold_what_the_placement_assigned():
    trace = generate_trace(TraceConfig(rps=40.0, duration_s=12.0, num_adapters=200, seed=2))
    universe = {f"lora-{i}": (8, 16, 32, 64)[i % 4] for i in range(200)}
    pol = make_policy("loraserve", PERF, 58.7, placement=PlacementConfig(interval_s=2.0))
    config = SimConfig(num_servers=4, adapter_store=AdapterStoreConfig(host_bytes=1 << 40))
    result = simulate(trace, pol, PERF, config, universe)
    assert len(result.requests) == len(trace) and result.pool is not None
    version, held = pol.holdings()
    assert version == pol.placer.version >= 4
    for url, names in held.items():
        cache = result.pool.caches[int(url.removeprefix("sim-"))]
        assert names <= set(cache.entries) and names == cache.pinned
    memory = result.summary(58.7)["adapter_memory"]
    assert memory["prefetches"] > 0 and memory["host_bytes_peak_max"] <= 1 << 40
