"""Cluster simulator: exact timing of a lone request, conservation, determinism, trace shape."""

from __future__ import annotations

import pytest

from toppings.scheduler.paper_models import paper_fig6_models
from toppings.scheduler.policies import POLICIES, make_policy
from toppings.scheduler.sim.simulator import SimConfig, simulate
from toppings.scheduler.sim.trace import TraceConfig, TraceRequest, generate_trace, trace_summary
from toppings.scheduler.state import BatchShape

PERF = paper_fig6_models()


def small_trace(seed: int = 0) -> list[TraceRequest]:
    config = TraceConfig(rps=40.0, duration_s=5.0, num_adapters=50, seed=seed)
    return generate_trace(config)


def test_lone_request_timing_is_prefill_then_decode_steps():
    request = TraceRequest(0, 1.0, "a", 32, prompt_tokens=100, output_tokens=5)
    result = simulate([request], make_policy("random", PERF, 50.0), PERF, SimConfig(2))
    prefill_ms = PERF.prefill("bgmv").predict(BatchShape.of([32], [100]))
    decode_ms = PERF.decode("bgmv").predict(BatchShape.of([32], [100]))
    (done,) = result.requests
    assert done.first_token_s == pytest.approx(1.0 + prefill_ms / 1000)
    assert done.finish_s == pytest.approx(1.0 + (prefill_ms + 4 * decode_ms) / 1000)


def test_simultaneous_arrivals_share_one_prefill_and_the_decode_batch():
    reqs = [TraceRequest(i, 0.0, "a", r, 10, 3) for i, r in enumerate((8, 64))]
    result = simulate(reqs, make_policy("first-fit", PERF, 100.0), PERF, SimConfig(1))
    prefill_ms = PERF.prefill("bgmv").predict(BatchShape.of([8, 64], [10, 10]))
    decode_ms = PERF.decode("bgmv").predict(BatchShape.of([8, 64], [10, 10]))  # padded to 64
    assert all(r.first_token_s == pytest.approx(prefill_ms / 1000) for r in result.requests)
    assert all(
        r.finish_s == pytest.approx((prefill_ms + 2 * decode_ms) / 1000) for r in result.requests
    )


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_request_finishes_once_in_order(name):
    trace = small_trace()
    config = SimConfig(num_servers=3, kernel="mbgmv", max_total_tokens=4000)
    result = simulate(trace, make_policy(name, PERF, 45.0, seed=1), PERF, config)
    assert sorted(r.trace.idx for r in result.requests) == list(range(len(trace)))
    assert sum(result.per_server_requests) == len(trace) and result.num_unrouted == 0
    for r in result.requests:
        assert r.trace.arrival_s < r.first_token_s <= r.finish_s
    summary = result.summary(45.0)
    assert 0.0 <= summary["slo_attainment"] <= 1.0
    assert summary["num_measured"] == sum(
        1 for r in trace if r.arrival_s >= config.warmup_fraction * trace[-1].arrival_s
    )


def test_same_seed_same_result():
    def run(seed: int) -> list[float]:
        policy = make_policy("random", PERF, 45.0, seed=seed)
        result = simulate(small_trace(), policy, PERF, SimConfig(num_servers=4))
        return [r.finish_s for r in sorted(result.requests, key=lambda r: r.trace.idx)]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_first_fit_uses_fewer_servers_than_least_loaded():
    trace = small_trace()
    config = SimConfig(num_servers=6)
    spread = {}
    for name in ("first-fit", "least-loaded"):
        result = simulate(trace, make_policy(name, PERF, 60.0), PERF, config)
        spread[name] = sum(1 for n in result.per_server_requests if n)
    assert spread["first-fit"] < spread["least-loaded"] == 6


def test_trace_is_seeded_poisson_zipf_lognormal():
    config = TraceConfig(rps=200.0, duration_s=30.0, num_adapters=1000, seed=5)
    trace = generate_trace(config)
    assert trace == generate_trace(config)
    assert trace != generate_trace(TraceConfig(rps=200.0, duration_s=30.0, seed=6))
    assert abs(len(trace) - 6000) < 4 * 6000**0.5  # Poisson count: mean 6000, sd ~77
    summary = trace_summary(trace)
    assert summary["mean_prompt_tokens"] == pytest.approx(69.5, rel=0.1)
    assert summary["mean_output_tokens"] == pytest.approx(214.5, rel=0.1)
    assert summary["share_top1_adapter"] > 0.1  # Zipf 1.1 over 1000: ~15% on the top one
    assert set(summary["request_share_by_rank"]) <= {"8", "16", "32", "64"}
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(trace, trace[1:]))


def test_stale_snapshots_are_corrected_by_routed_counts():
    """One snapshot for the whole trace: least-loaded still spreads, on its own routed counts."""
    trace = small_trace()
    config = SimConfig(num_servers=4, refresh_s=1000.0)
    result = simulate(trace, make_policy("least-loaded", PERF, 60.0), PERF, config)
    counts = result.per_server_requests
    assert sum(counts) == len(trace) and max(counts) - min(counts) <= 1
