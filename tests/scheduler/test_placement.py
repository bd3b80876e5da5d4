"""LoRAServe placement: operating points, the packing's promises, relabelling and membership."""

from __future__ import annotations

import random

import pytest

from toppings.scheduler.demand import DemandTracker
from toppings.scheduler.operating_points import OperatingPointConfig, batch_at, operating_points
from toppings.scheduler.paper_models import paper_fig6_models
from toppings.scheduler.placement import count_moves, place

PERF = paper_fig6_models()
RANKS = (8, 16, 32, 64)
POINTS = operating_points(PERF, OperatingPointConfig(slo_ms=58.7), RANKS)


def workload(num_adapters: int = 400, num_hot: int = 120, total: float = 60_000.0, seed: int = 0):
    """Zipf demand (tokens/s) over the first `num_hot` adapters; the rest have none."""
    rng = random.Random(seed)
    ranks = {f"a{i}": rng.choice(RANKS) for i in range(num_adapters)}
    weights = [1.0 / (i + 1) ** 1.1 for i in range(num_hot)]
    demand = {f"a{i}": total * w / sum(weights) for i, w in enumerate(weights)}
    return demand, ranks


SERVERS = [f"s{i}" for i in range(12)]


def test_operating_points_fall_with_rank_and_respect_the_slo():
    assert [POINTS[r] for r in RANKS] == sorted(POINTS.values(), reverse=True)
    tight = operating_points(PERF, OperatingPointConfig(slo_ms=45.0), RANKS)
    assert all(tight[r] < POINTS[r] for r in RANKS)
    # A looser SLO cannot lower a point; the batch limit caps it.
    loose = operating_points(PERF, OperatingPointConfig(slo_ms=1e6, max_batch_size=4), RANKS)
    assert all(loose[r] > 0 for r in RANKS)


def test_batch_at_an_operating_point_grows_with_the_point_and_falls_with_rank():
    config = OperatingPointConfig(slo_ms=58.7)
    # the derived point is reached at the largest batch within headroom x SLO, and not before
    limits = {r: batch_at(PERF, config, r, POINTS[r]) for r in RANKS}
    assert [limits[r] for r in RANKS] == sorted(limits.values(), reverse=True)
    assert all(batch_at(PERF, config, r, 0.8 * POINTS[r]) < limits[r] for r in RANKS)
    assert batch_at(PERF, config, 8, 1e12) == config.max_batch_size  # unreachable: the cap


def test_every_adapter_is_placed_and_probabilities_sum_to_one():
    demand, ranks = workload()
    result = place(demand, ranks, SERVERS, POINTS)
    assert set(result.assignment) == set(ranks)
    for shares in result.assignment.values():
        assert sum(shares.values()) == pytest.approx(1.0)
        assert all(p > 0 for p in shares.values()) and set(shares) <= set(SERVERS)
    rows = result.routes()
    assert {r.adapter for r in rows} == set(ranks)


def test_load_per_server_stays_within_the_target_and_demand_is_conserved():
    demand, ranks = workload()
    result = place(demand, ranks, SERVERS, POINTS)
    total = sum(d / POINTS[ranks[a]] for a, d in demand.items())
    assert result.target_util == pytest.approx(total / len(SERVERS))
    load = dict.fromkeys(SERVERS, 0.0)
    for a, shares in result.assignment.items():
        for server, p in shares.items():
            load[server] += p * demand.get(a, 0.0) / POINTS[ranks[a]]
    assert sum(load.values()) == pytest.approx(total)
    assert max(load.values()) <= result.target_util * 1.02
    assert load == pytest.approx(result.server_util)


def test_hot_adapters_span_servers_and_ranks_are_kept_apart():
    demand, ranks = workload()
    result = place(demand, ranks, SERVERS, POINTS)
    hottest = max(demand, key=demand.get)
    assert len(result.assignment[hottest]) >= 2  # more demand than one server's target
    # Most servers carry demand of a single rank (rank budgets), unlike a random spread.
    mixed = 0
    for server in SERVERS:
        demanded = {ranks[a] for a, s in result.assignment.items() if server in s and a in demand}
        mixed += len(demanded) > 1
    assert mixed <= len(RANKS) + 1


def test_relabelling_keeps_adapters_where_they_were():
    demand, ranks = workload()
    first = place(demand, ranks, SERVERS, POINTS)
    rng = random.Random(1)
    drifted = {a: d * rng.uniform(0.8, 1.2) for a, d in demand.items()}
    again = place(drifted, ranks, SERVERS, POINTS, first.assignment)
    # The same placement on shuffled server names: what a step without relabelling would do.
    shuffled = SERVERS[1:] + SERVERS[:1]
    blind = place(drifted, ranks, shuffled, POINTS)
    assert again.moves == count_moves(again.assignment, first.assignment)
    assert again.moves < count_moves(blind.assignment, first.assignment) / 4
    assert again.moves < len(ranks) / 10


def test_a_dead_server_is_replaced_at_once_and_a_new_one_gets_a_share():
    demand, ranks = workload()
    first = place(demand, ranks, SERVERS, POINTS)
    dead = "s3"
    lost = {a for a, shares in first.assignment.items() if dead in shares}
    survivors = [s for s in SERVERS if s != dead]
    after = place(demand, ranks, survivors, POINTS, first.assignment)
    assert all(dead not in shares for shares in after.assignment.values())
    assert set(after.assignment) == set(ranks)  # nothing lost
    assert all(sum(after.assignment[a].values()) == pytest.approx(1.0) for a in lost)
    grown = place(demand, ranks, [*SERVERS, "s-new"], POINTS, first.assignment)
    assert grown.server_util["s-new"] > 0
    assert any("s-new" in shares for a, shares in grown.assignment.items() if a in demand)


def test_idle_adapters_join_a_server_of_their_rank_and_spread_evenly():
    ranks = {f"a{i}": RANKS[i % 4] for i in range(400)}
    demand = {"a0": 5000.0, "a1": 5000.0, "a2": 5000.0, "a3": 5000.0}  # one of each rank
    result = place(demand, ranks, SERVERS, POINTS)
    for a, shares in result.assignment.items():
        if a not in demand:
            (server,) = shares
            assert result.server_max_rank[server] >= ranks[a]
    counts = result.adapters_per_server()
    assert sum(counts.values()) >= 400
    for level in set(result.server_max_rank.values()):
        held = [n for s, n in counts.items() if result.server_max_rank[s] == level]
        assert max(held) - min(held) <= 2  # the busy adapters' copies, then even


def test_demand_tracker_rates_and_smoothing():
    tracker = DemandTracker(smoothing=0.5, trend=0.0)  # a plain moving average
    for _ in range(10):
        tracker.record("a", 8, prompt_tokens=50, max_new_tokens=50)
    assert tracker.roll(10.0) == {"a": pytest.approx(0.5 * 100.0)}  # 1000 tokens over 10 s
    tracker.record("b", 16, 10, 10)
    second = tracker.roll(10.0)
    assert second["a"] == pytest.approx(25.0) and second["b"] == pytest.approx(1.0)
    assert tracker.ranks() == {"a": 8, "b": 16}
    assert tracker.mean_lengths() == pytest.approx((50 - 40 / 11, 50 - 40 / 11))
    with pytest.raises(ValueError):
        tracker.roll(0.0)


def test_demand_tracker_extrapolates_a_climbing_adapter():
    plain, holt = DemandTracker(0.5, trend=0.0), DemandTracker(0.5, trend=0.5)
    for step in range(1, 9):  # the rate climbs by 10 tokens/s every step
        for tracker in (plain, holt):
            tracker.record("up", 8, prompt_tokens=100 * step, max_new_tokens=0)
        lagging, ahead = plain.roll(10.0)["up"], holt.roll(10.0)["up"]
    assert lagging < 80.0 < ahead  # the last rate was 80 tokens/s
    for _ in range(30):  # silence: the forecast falls to nothing and the adapter is dropped
        forecast = holt.roll(10.0)
    assert "up" not in forecast and all(v > 0 for v in forecast.values())
