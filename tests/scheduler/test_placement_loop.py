"""The scheduler's placement loop: routing table into the registry, membership, restart."""

from __future__ import annotations

import dataclasses

from toppings.scheduler.loraserve import PlacementConfig
from toppings.scheduler.paper_models import paper_fig6_models
from toppings.scheduler.placement_loop import PlacementLoop
from toppings.scheduler.policies import make_policy
from toppings.scheduler.registry import AdapterRecord, Registry, ServerRecord
from toppings.scheduler.state import BatchShape, ServerState

URLS = [f"http://127.0.0.1:81{i:02d}" for i in range(3)]
ADAPTERS = {f"a{i}": (8, 64)[i % 2] for i in range(12)}


class StubCluster:
    """What the loop reads of a Cluster: the servers' states."""

    def __init__(self, states: list[ServerState]):
        self.current = states

    def states(self) -> list[ServerState]:
        return self.current


def state(url: str, healthy: bool = True) -> ServerState:
    return ServerState(url, "bgmv", healthy, 0, 0, BatchShape(), BatchShape(), 10_000)


def make_registry(path) -> Registry:
    registry = Registry(path)
    for url in URLS:
        registry.put_server(ServerRecord(url, "llama", "bgmv", "cpu"), [])
    for name, rank in ADAPTERS.items():
        registry.put_adapter(AdapterRecord(name, "llama", rank))
    return registry


def loop_for(registry: Registry, cluster: StubCluster) -> PlacementLoop:
    policy = make_policy("loraserve", paper_fig6_models(), 58.7,
                         placement=PlacementConfig(interval_s=10.0))  # fmt: skip
    return PlacementLoop(policy, cluster, registry, period_s=0.1)


def test_table_written_then_replaced_when_a_server_dies_and_kept_across_restart(tmp_path):
    registry = make_registry(tmp_path / "reg.sqlite")
    cluster = StubCluster([state(u) for u in URLS])
    loop = loop_for(registry, cluster)
    assert not loop.run_once(0.0)  # starts the clock
    assert loop.run_once(10.0)
    table = registry.routes()
    assert set(table) == set(ADAPTERS)
    assert all(abs(sum(row.values()) - 1) < 1e-9 for row in table.values())
    assert not loop.run_once(11.0)  # nothing due, nobody died
    cluster.current = [dataclasses.replace(s, healthy=s.url != URLS[1]) for s in cluster.current]
    assert loop.run_once(12.0)
    table = registry.routes()
    assert set(table) == set(ADAPTERS)
    assert all(URLS[1] not in row for row in table.values())
    # A restarted scheduler starts from the recorded table: its first step moves nothing.
    restarted = loop_for(registry, cluster)
    assert not restarted.run_once(0.0)
    assert restarted.run_once(10.0)
    assert restarted.placer.history[-1]["moves"] == 0
    assert registry.routes() == table
    registry.close()


def test_routing_only_policies_write_no_table(tmp_path):
    registry = make_registry(tmp_path / "reg.sqlite")
    policy = make_policy("rank-aware", paper_fig6_models(), 58.7)
    loop = PlacementLoop(policy, StubCluster([state(u) for u in URLS]), registry, 0.1)
    assert not loop.run_once(0.0) and not loop.run_once(100.0)
    assert registry.routes() == {}
    registry.close()
