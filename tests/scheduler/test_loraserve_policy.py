"""The loraserve policy: routing on the table, the placement clock, membership changes."""

from __future__ import annotations

import dataclasses
from collections import Counter

from toppings.scheduler.loraserve import PlacementConfig
from toppings.scheduler.paper_models import paper_fig6_models
from toppings.scheduler.policies import make_policy
from toppings.scheduler.sim.simulator import SimConfig, simulate
from toppings.scheduler.sim.trace import TraceConfig, generate_trace
from toppings.scheduler.state import BatchShape, RouteRequest, ServerState

PERF = paper_fig6_models()
SLO_MS = 58.7


def idle(
    url: str, healthy: bool = True, running: int = 0, rank: int = 8, hosts: tuple = ()
) -> ServerState:
    batch = BatchShape.of([rank] * running, [100] * running)
    return ServerState(
        url, "bgmv", healthy, running, 0, batch, BatchShape(), 100_000, frozenset(hosts)
    )


def request(adapter: str, rank: int) -> RouteRequest:
    return RouteRequest(adapter, rank, prompt_tokens=100, max_new_tokens=100)


def policy(interval_s: float = 10.0, name: str = "loraserve"):
    return make_policy(name, PERF, SLO_MS, placement=PlacementConfig(interval_s=interval_s))


ADAPTERS = {f"a{i}": (8, 16, 32, 64)[i % 4] for i in range(40)}


def test_requests_follow_the_table_and_demand_moves_it():
    servers = [idle(f"s{i}") for i in range(4)]
    pol = policy()
    pol.tick(0.0, servers, ADAPTERS)  # starts the clock: no table yet, the cost decides
    assert pol.placer.row("a1") is None and pol.placer.version == 0
    pol.tick(10.0, servers, ADAPTERS)  # first step, without demand: every adapter gets a home
    home = pol.placer.assignment["a1"]
    assert len(home) == 1 and sum(home.values()) == 1.0
    (url,) = home
    assert servers[pol.choose(request("a1", 16), servers)].url == url
    for _ in range(400):  # a1 becomes the hot adapter
        pol.choose(request("a1", 16), servers)
    pol.tick(15.0, servers, ADAPTERS)
    assert pol.placer.version == 1  # not due yet
    pol.tick(20.0, servers, ADAPTERS)
    assert pol.placer.version == 2
    assert len(pol.placer.assignment["a1"]) >= 2  # its demand now spans servers
    counts = Counter(servers[pol.choose(request("a1", 16), servers)].url for _ in range(400))
    assert set(counts) <= set(pol.placer.assignment["a1"])
    assert pol.placer.history[-1]["moves"] >= 1


def test_a_full_row_spills_to_another_server_and_unplaced_adapters_use_the_cost():
    servers = [idle(f"s{i}", hosts=("a", "zzz")) for i in range(3)]
    pol = policy()
    pol.tick(0.0, servers, {"a": 64})
    pol.tick(10.0, servers, {"a": 64})
    (url,) = pol.placer.assignment["a"]
    full = [idle(url, running=120, rank=64) if s.url == url else s for s in servers]
    chosen = full[pol.choose(request("a", 64), full)].url
    assert chosen != url  # the row is over the SLO: the request leaves it for a holder
    lacking = [idle(s.url) for s in full]  # nobody else holds "a": it stays in its row
    assert lacking[pol.choose(request("a", 64), lacking)].url == url
    unplaced = pol.order(request("zzz", 8), servers)
    assert sorted(unplaced) == [0, 1, 2]


def test_a_dead_server_is_replaced_at_once_and_a_new_server_joins_at_the_next_step():
    servers = [idle(f"s{i}") for i in range(3)]
    pol = policy()
    pol.tick(0.0, servers, ADAPTERS)
    for i in range(200):
        pol.choose(request(f"a{i % 8}", (8, 16, 32, 64)[i % 4]), servers)
    pol.tick(10.0, servers, ADAPTERS)
    version = pol.placer.version
    dead = [dataclasses.replace(s, healthy=s.url != "s1") for s in servers]
    pol.tick(11.0, dead, ADAPTERS)  # mid-interval: re-placed at once
    assert pol.placer.version == version + 1
    assert pol.placer.history[-1]["reason"] == "membership"
    assert all("s1" not in shares for shares in pol.placer.assignment.values())
    assert set(pol.placer.assignment) == set(ADAPTERS)
    grown = [*dead, idle("s9")]
    pol.tick(12.0, grown, ADAPTERS)  # a new server alone does not trigger a step
    assert pol.placer.version == version + 1
    for i in range(200):
        pol.choose(request(f"a{i % 8}", (8, 16, 32, 64)[i % 4]), grown)
    pol.tick(20.0, grown, ADAPTERS)
    assert any("s9" in shares for shares in pol.placer.assignment.values())


def test_simulated_cluster_serves_every_request_and_each_server_holds_a_fraction():
    trace = generate_trace(TraceConfig(rps=60.0, duration_s=20.0, num_adapters=400,
                                       drift_per_s=1.0, seed=3))  # fmt: skip
    universe = {f"lora-{i}": r for i, r in enumerate((8, 16, 32, 64) * 100)}
    universe.update({r.adapter: r.rank for r in trace})
    pol = make_policy("loraserve", PERF, SLO_MS, placement=PlacementConfig(interval_s=2.0))
    result = simulate(trace, pol, PERF, SimConfig(num_servers=6), universe)
    assert len(result.requests) == len(trace) and result.num_unrouted == 0
    steps = pol.placer.history
    assert len(steps) >= 8 and {s["reason"] for s in steps} == {"interval"}
    assert all(s["adapters_per_server_max"] < len(universe) / 2 for s in steps)


def test_drift_moves_the_popular_head():
    config = TraceConfig(rps=200.0, duration_s=20.0, num_adapters=1000, drift_per_s=2.0)
    trace = generate_trace(config)
    early = Counter(r.adapter for r in trace if r.arrival_s < 2.0).most_common(1)[0][0]
    late = Counter(r.adapter for r in trace if r.arrival_s > 18.0).most_common(1)[0][0]
    assert early != late
    still = generate_trace(dataclasses.replace(config, drift_per_s=0.0))
    assert Counter(r.adapter for r in still).most_common(1)[0][0] == "lora-0"


def test_every_server_appears_once_in_the_order():
    servers = [idle(f"s{i}", hosts=tuple(ADAPTERS)) for i in range(6)]
    for name in ("loraserve", "loraserve-row", "loraserve-group"):
        pol = make_policy(name, PERF, SLO_MS, placement=PlacementConfig(interval_s=10.0))
        pol.tick(0.0, servers, ADAPTERS)
        for i in range(300):
            pol.choose(request(f"a{i % 6}", (8, 16, 32, 64)[i % 4]), servers)
        pol.tick(10.0, servers, ADAPTERS)
        for adapter, rank in ADAPTERS.items():
            ranked = pol.order(request(adapter, rank), servers)
            assert sorted(ranked) == list(range(6)), (name, adapter)
            first = servers[ranked[0]].url
            assert first in pol.placer.assignment[adapter] or name != "loraserve-row"


ALL = ("a", "b", "c", "d")


def _placed_four(name: str = "loraserve"):
    """s0 placed with rank 8 only; a's row is {s2, s3}; s1 is placed with rank 64."""
    pol = policy(name=name)
    servers = [idle(f"s{i}") for i in range(4)]
    names = {"a": 64, "b": 8, "c": 64, "d": 8}
    pol.tick(0.0, servers, names)
    for i in range(400):
        name = "abcd"[i % 4]
        pol.choose(request(name, names[name]), servers)
    pol.tick(10.0, servers, names)
    assert [pol.placer.max_rank(f"s{i}") for i in range(4)] == [8, 64, 64, 64]
    assert set(pol.placer.assignment["a"]) == {"s2", "s3"} and pol.placer.row("b")[0] == ("s0",)
    return pol


def test_a_row_past_its_operating_point_spills_before_the_decode_slo():
    pol = _placed_four("loraserve-row")
    calm = [idle("s0", running=10, hosts=ALL), *(idle(f"s{i}", hosts=ALL) for i in (1, 2, 3))]
    assert pol.choose(request("b", 8), calm) == 0
    # 110 rank-8 requests: a decode iteration (~35 ms) is well within the SLO, but with each
    # member's share of the newcomers' prefills the time per token is past headroom x SLO
    busy = [idle("s0", running=110, hosts=ALL), *calm[1:]]
    assert pol._key(request("b", 8), busy[0])[2] < SLO_MS
    assert pol.choose(request("b", 8), busy) != 0


def test_a_spill_prefers_servers_it_does_not_pad():
    pol = _placed_four("loraserve-row")
    servers = [
        idle(
            "s0", running=5, hosts=ALL
        ),  # placed with rank 8: a rank-64 request would pad its batch
        idle("s1", running=5, hosts=ALL),  # placed with rank 64: same load, same cost
        idle("s2", running=120, rank=64, hosts=ALL),  # a's row, full
        idle("s3", running=120, rank=64, hosts=ALL),
    ]
    assert pol.choose(request("a", 64), servers) == 1


def test_a_server_past_its_operating_point_goes_after_one_within_it_at_any_cost():
    pol = _placed_four()
    limit = pol.placer.batch_limit(64)
    servers = [
        idle("s0", running=limit + 1, rank=64, hosts=ALL),  # cheap for rank 64, but full
        idle("s1", running=20, rank=8, hosts=ALL),  # a rank-64 request pads it: dearer
    ]
    rank_aware = make_policy("rank-aware", PERF, SLO_MS)
    assert rank_aware.choose(request("a", 64), servers) == 0
    assert pol.order(request("a", 64), servers) == [1, 0]
    calm = [idle("s0", running=limit - 5, rank=64, hosts=ALL), servers[1]]
    assert pol.choose(request("a", 64), calm) == rank_aware.choose(request("a", 64), calm) == 0
