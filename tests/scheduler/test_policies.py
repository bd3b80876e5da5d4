"""Routing policies: the paper's Fig. 6 example, and the behaviour each baseline promises."""

from __future__ import annotations

from dataclasses import replace

import pytest

from toppings.scheduler.paper_models import paper_fig6_models
from toppings.scheduler.perf_model import LinearPerfModel, PerfModels
from toppings.scheduler.policies import POLICIES, make_policy
from toppings.scheduler.state import BatchShape, RouteRequest, ServerState

PROMPT = 100


def server(
    url: str,
    running_ranks: list[int],
    kernel: str = "bgmv",
    queued_ranks: tuple[int, ...] = (),
    healthy: bool = True,
    room_tokens: int = 100_000,
    adapters: frozenset[str] = frozenset({"a"}),
) -> ServerState:
    running = BatchShape.of(running_ranks, [PROMPT] * len(running_ranks))
    queue = BatchShape.of(queued_ranks, [PROMPT] * len(queued_ranks))
    return ServerState(
        url=url,
        kernel=kernel,
        healthy=healthy,
        num_running=len(running_ranks),
        num_queued=len(queued_ranks),
        batch=running.merge(queue),
        queue=queue,
        room_tokens=room_tokens,
        adapters=adapters,
    )


def models(a_b: float, b_b: float, a_m: float, b_m: float) -> PerfModels:
    """Decode models from the given Eq. 2 coefficients; prefill: 30 ms + 0.07 ms per token."""
    return PerfModels(
        {
            "bgmv_decode": LinearPerfModel("bgmv", "decode", b_b, (a_b,)),
            "mbgmv_decode": LinearPerfModel("mbgmv", "decode", b_m, (a_m,)),
            "bgmv_prefill": LinearPerfModel("bgmv", "prefill", 30.0, (0.07, 0.0001)),
            "mbgmv_prefill": LinearPerfModel("mbgmv", "prefill", 30.0, (0.07, 0.0001)),
        }
    )


R64 = RouteRequest(adapter="a", rank=64, prompt_tokens=PROMPT, max_new_tokens=128)


def fig6_servers(kernel: str) -> list[ServerState]:
    return [server("inst1", [32] * 24, kernel), server("inst2", [64] * 16, kernel)]


def test_fig6_rank_aware_bgmv_to_inst2_mbgmv_to_inst1():
    """Fig. 6, reading its latencies as each instance's current decode iteration.

    BGMV pads to the max rank, so the batch term is |S| * max rank:
        inst1: 24 * 32 = 768 -> 34.8 ms;  inst2: 16 * 64 = 1024 -> 35.8 ms
        a_B = 1.0 / 256 ms,  b_B = 34.8 - 768 / 256 = 31.8 ms
    MBGMV runs each request at its own rank, so the term is sum rank (768 and 1024 again):
        inst1 -> 35.3 ms;  inst2 -> 35.9 ms
        a_M = 0.6 / 256 = 0.00234375 ms,  b_M = 35.3 - 768 * a_M = 33.5 ms
    A new rank-64 request, SLO 36 ms:
        BGMV  inst1: 25 * 64 = 1600 -> 31.8 + 6.25 = 38.05 > 36 (rank 32 padded to 64)
              inst2: 17 * 64 = 1088 -> 31.8 + 4.25 = 36.05 > 36
              Algorithm 1 gives both +inf; the tie goes to the smaller violation: inst2.
        MBGMV inst1: 768 + 64 = 832   -> 33.5 + 1.95 = 35.45 <= 36, finite cost
              inst2: 1024 + 64 = 1088 -> 33.5 + 2.55 = 36.05 > 36, +inf: inst1.
    """
    a_b, b_b = 1.0 / 256, 34.8 - 768 / 256
    a_m = 0.6 / 256
    b_m = 35.3 - 768 * a_m
    perf = models(a_b, b_b, a_m, b_m)
    for kernel, observed in (("bgmv", (34.8, 35.8)), ("mbgmv", (35.3, 35.9))):
        predicted = [perf.decode(kernel).predict(s.batch) for s in fig6_servers(kernel)]
        assert predicted == pytest.approx(observed)
    # The coefficients shipped for the simulator are the same derivation.
    paper = paper_fig6_models()
    for kernel in ("bgmv", "mbgmv"):
        assert paper.decode(kernel).intercept == pytest.approx(perf.decode(kernel).intercept)
        assert paper.decode(kernel).coefficients == pytest.approx(perf.decode(kernel).coefficients)

    policy = make_policy("rank-aware", perf, slo_ms=36.0)
    assert policy.decode_after(R64, fig6_servers("bgmv")[0]) == pytest.approx(38.05)
    assert policy.decode_after(R64, fig6_servers("bgmv")[1]) == pytest.approx(36.05)
    assert policy.decode_after(R64, fig6_servers("mbgmv")[0]) == pytest.approx(35.45)
    assert policy.decode_after(R64, fig6_servers("mbgmv")[1]) == pytest.approx(36.05)
    assert policy.choose(R64, fig6_servers("bgmv")) == 1
    assert policy.choose(R64, fig6_servers("mbgmv")) == 0
    assert policy.order(R64, fig6_servers("mbgmv")) == [0, 1]


def test_fig6_as_latencies_after_placement_count_weighting_decides():
    """The other reading of Fig. 6: 35.8 / 34.8 (BGMV) and 35.3 / 35.9 (MBGMV) are the latencies
    of inst1 / inst2 with the new request. Then nothing breaks the SLO and Algorithm 1 compares
    dDecode * (running + queue): BGMV 24 * 832 a_B vs 16 * 64 a_B sends it to inst2, but MBGMV's
    increase is 64 a_M on both, so the smaller count (16) sends it to inst2 as well."""
    a_b = (35.8 - 34.8) / (1600 - 1088)
    a_m = (35.9 - 35.3) / (1088 - 832)
    perf = models(a_b, 35.8 - 1600 * a_b, a_m, 35.3 - 832 * a_m)
    policy = make_policy("rank-aware", perf, slo_ms=36.0)
    assert policy.decode_after(R64, fig6_servers("bgmv")[0]) == pytest.approx(35.8)
    assert policy.decode_after(R64, fig6_servers("mbgmv")[0]) == pytest.approx(35.3)
    assert policy.choose(R64, fig6_servers("bgmv")) == 1
    assert policy.choose(R64, fig6_servers("mbgmv")) == 1


def test_rank_aware_prefers_idle_server_and_groups_low_ranks_under_bgmv():
    perf = paper_fig6_models()
    policy = make_policy("rank-aware", perf, slo_ms=50.0)
    busy = [server("s0", [8] * 10), server("s1", [64] * 10)]
    assert policy.choose(R64, busy + [server("idle", [])]) == 2
    r8 = RouteRequest("a", 8, PROMPT, 128)
    # Under BGMV a rank-8 request costs a_B * 64 on the rank-64 server but a_B * 8 where every
    # request is rank 8; a rank-64 one would pad the rank-8 batch to 64.
    assert policy.choose(r8, busy) == 0
    assert policy.choose(R64, busy) == 1


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_unhealthy_or_not_hosting_never_picked(name):
    policy = make_policy(name, paper_fig6_models(), slo_ms=50.0, seed=3)
    servers = [
        server("down", [], healthy=False),
        server("other", [], adapters=frozenset({"b"})),
        server("busy", [64] * 30),
    ]
    for _ in range(20):
        assert policy.choose(R64, servers) == 2
        assert policy.order(R64, servers) == [2]
    assert policy.choose(R64, servers[:2]) is None


def test_random_is_seeded():
    servers = [server(f"s{i}", []) for i in range(8)]

    def picks(seed: int) -> list[int | None]:
        policy = make_policy("random", paper_fig6_models(), 50.0, seed=seed)
        return [policy.choose(R64, servers) for _ in range(30)]

    assert picks(7) == picks(7)
    assert picks(7) != picks(8)
    assert len(set(picks(7))) > 1


def test_first_fit_consolidates_until_full():
    """Requests pile onto the first server until its SLO or KV room is used up."""
    policy = make_policy("first-fit", paper_fig6_models(), slo_ms=40.0)
    servers = [server(f"s{i}", []) for i in range(3)]
    picks = []
    for _ in range(40):
        idx = policy.choose(R64, servers)
        picks.append(idx)
        servers[idx] = servers[idx].with_routed(64, PROMPT, 128)
    # BGMV rank 64: 31.8 + n * 64 / 256 <= 40 holds up to n = 32 requests.
    assert picks[:32] == [0] * 32
    assert picks[32:] == [1] * 8
    full = [server("kv-full", [], room_tokens=100), server("free", [])]
    assert policy.choose(R64, full) == 1


def test_least_loaded_balances_and_breaks_ties_by_latency():
    policy = make_policy("least-loaded", paper_fig6_models(), slo_ms=50.0)
    servers = [server("s0", [8] * 5), server("s1", [8] * 2), server("s2", [8] * 3)]
    assert policy.choose(R64, servers) == 1
    # Same count: the lower predicted latency wins; under BGMV a rank-8 request joining rank-64
    # requests is padded to 64, joining rank-8 ones it is not.
    tie = [server("r64", [64] * 4), server("r8", [8] * 4)]
    assert policy.choose(RouteRequest("a", 8, PROMPT, 128), tie) == 1


@pytest.mark.parametrize(
    ("name", "kernel", "num_requests", "expected"),
    [("least-loaded", "bgmv", 12, [3, 3, 3, 3]), ("rank-aware", "mbgmv", 24, [6, 6, 6, 6])],
)
def test_routed_count_spreads_a_burst(name, kernel, num_requests, expected):
    """Between two /stats snapshots the scheduler adds its own routed requests to the state, so a
    burst spreads over 4 identical servers instead of piling onto the one the snapshot favours.
    (Rank-aware sends ~5 in a row to one server: joining a prefill already queued there costs
    only the prompt tokens, not another iteration.)"""
    policy = make_policy(name, paper_fig6_models(), slo_ms=60.0)
    servers = [server(f"s{i}", [32] * 4, kernel) for i in range(4)]
    counts = [0] * 4
    for _ in range(num_requests):
        idx = policy.choose(R64, servers)
        counts[idx] += 1
        servers[idx] = servers[idx].with_routed(64, PROMPT, 128)
    assert counts == expected
    stale = [server(f"s{i}", [32] * 4, kernel) for i in range(4)]
    assert {policy.choose(R64, stale) for _ in range(num_requests)} == {0}


def test_unknown_policy_name():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("round-robin", paper_fig6_models(), 50.0)


@pytest.mark.parametrize("running", [[], [8, 16]])
@pytest.mark.parametrize("name", ["rank-aware", "loraserve"])
def test_rank_aware_prefers_the_server_with_the_adapter_on_its_device(name, running):
    """At equal load, the only server holding the adapter on its device wins over one holding
    it in host memory, and one where it is loading over one where it is in host memory, in
    either server order; the base model's requests see no difference."""
    policy = make_policy(name, paper_fig6_models(), slo_ms=1000.0)
    adapters = frozenset({"a", "b"})
    host = server("host", running, adapters=adapters)
    device = replace(server("device", running, adapters=adapters),
                     device_adapters=frozenset({"a"}))  # fmt: skip
    loading = replace(server("loading", running, adapters=adapters),
                      loading_adapters=frozenset({"a"}))  # fmt: skip
    request = RouteRequest(adapter="a", rank=8, prompt_tokens=PROMPT, max_new_tokens=16)
    assert policy.order(request, [host, device]) == [1, 0]
    assert policy.order(request, [device, host]) == [0, 1]
    assert policy.order(request, [host, loading, device]) == [2, 1, 0]
    base = RouteRequest(adapter=None, rank=0, prompt_tokens=PROMPT, max_new_tokens=16)
    assert policy.order(base, [host, device]) == [0, 1]  # server order, as before


def test_residency_does_not_outweigh_load():
    """A server with the adapter on its device but a heavier batch loses to a lighter one."""
    policy = make_policy("rank-aware", models(1 / 256, 30.0, 0.6 / 256, 30.0), slo_ms=1000.0)
    light = server("light", [8])
    heavy = replace(server("heavy", [64] * 8), device_adapters=frozenset({"a"}))
    request = RouteRequest(adapter="a", rank=8, prompt_tokens=PROMPT, max_new_tokens=16)
    assert policy.choose(request, [heavy, light]) == 1
