"""The simulator's on-demand adapters (bench/sim_adapters.py): loads over one link, a budget
with the engine's eviction policies, no cache for slora's rows; and whole runs of the four
configurations through the real scheduler."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.queueing_sim import SIM_CONFIGS, Sim
from bench.sim_adapters import SimAdapterCache, SimLink
from bench.sim_engine import SimCache, SimLimits, StepModel, run
from toppings.gpu_lora.eviction import make_policy
from toppings.server.config import SchedulingConfig
from toppings.server.sched.queueing import FcfsQueue
from toppings.server.sched.step_budget import StepBudget


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def take(cache: SimAdapterCache, name: str):
    """Admission's order: make room, then acquire (which only allocates)."""
    cache.make_room(name, frozenset())
    return cache.acquire(name)


def cache_of(keep_idle: bool, budget: int = 300) -> tuple[SimAdapterCache, Clock]:
    clock = Clock()
    link = SimLink(gbps=8e-9 * 100, latency_s=0.0)  # 100 bytes a second
    ranks = {"a": 1, "b": 1, "c": 2}
    return SimAdapterCache(ranks, 100, budget, link, make_policy("lru"), keep_idle, clock), clock


def test_loads_run_one_after_another_and_a_request_starts_once_its_load_landed():
    cache, clock = cache_of(keep_idle=True)
    a, b = take(cache, "a"), take(cache, "b")
    assert (a.ready_s, b.ready_s) == pytest.approx((1.0, 2.0))
    assert not cache.may_start(b) and cache.next_ready_s() == pytest.approx(1.0)
    clock.now = 2.0
    assert cache.may_start(a) and cache.may_start(b) and cache.next_ready_s() is None


def test_without_a_cache_an_adapter_leaves_with_its_last_request_and_is_loaded_again():
    for keep_idle, loads in ((False, 2), (True, 1)):
        cache, clock = cache_of(keep_idle)
        entry = take(cache, "a")
        clock.now = 5.0
        cache.release("a", entry)
        assert ("a" in cache.entries) is keep_idle
        take(cache, "a")
        assert cache.num_loads == loads


def test_the_budget_evicts_idle_adapters_and_waits_when_all_are_held():
    cache, clock = cache_of(keep_idle=True, budget=300)
    a = take(cache, "a")
    take(cache, "b")
    assert not cache.make_room("c", frozenset())  # 200 more bytes: both others are held
    assert cache.acquire("c") is None and cache.used_bytes == 200  # nothing evicted
    clock.now = 10.0
    cache.release("a", a)
    assert cache.fits_if_released("c", "b") is False  # a's release already made the room
    assert take(cache, "c") is not None and "a" not in cache.entries


def test_nothing_is_prefetched_without_a_cache():
    for keep_idle in (False, True):
        cache, _ = cache_of(keep_idle)
        cache.prefetch(["a"], frozenset())
        assert ("a" in cache.entries) is keep_idle


def entry(prompt: int, out: int, at: float, adapter: str) -> SimpleNamespace:
    return SimpleNamespace(prompt=[0] * prompt, max_tokens=out, arrival_s=at, model=adapter)


def test_a_request_gets_its_first_token_only_after_its_adapter_crossed_the_link():
    cache = SimCache(budget_bytes=10_000, bytes_per_rank=1000, slot_bytes=10, link_gbps=8e-6)
    limits = SimLimits(4096, 8, 8192, {"a": 4}, budget=StepBudget(256, 0.0, "test"), cache=cache)
    policy = FcfsQueue(SchedulingConfig(), 4096)
    (seq,) = run(policy, limits, [entry(20, 4, 0.0, "a")], StepModel())
    assert seq.first_token_s >= 4.0  # 4000 bytes at 1000 bytes a second
    assert seq.finish_s > seq.first_token_s


def test_with_stall_for_load_a_running_stream_waits_for_another_request_s_load():
    """on-demand: the stream decodes while the newcomer's adapter crosses the link; with
    on-demand-sync the step that starts the newcomer waits for it, the stream with it."""
    finish = {}
    for stall in (False, True):
        cache = SimCache(budget_bytes=10_000, bytes_per_rank=1000, slot_bytes=10,
                         link_gbps=8e-6, stall_for_load=stall)  # fmt: skip
        limits = SimLimits(4096, 8, 8192, {"a": 0, "b": 4}, budget=StepBudget(256, 0.0, "test"),
                           cache=cache)  # fmt: skip
        trace = [entry(20, 200, 0.0, "a"), entry(20, 4, 0.5, "b")]  # b: 4 s over the link
        stream, newcomer = run(FcfsQueue(SchedulingConfig(), 4096), limits, trace, StepModel())
        assert newcomer.first_token_s >= 4.5
        finish[stall] = stream.finish_s
    assert finish[True] > finish[False] + 3.0  # the stream sat out most of the load


def sim_args(**over) -> SimpleNamespace:
    args = dict(per_rank=2, max_prompt_len=256, output_len="lognormal:20:0.5", max_output_len=64,
                max_total_tokens=1024, max_batch_size=16, max_prefill_tokens=8192,
                max_num_batched_tokens=0, chunked_prefill=True, link_latency_us=10.0,
                adapter_bytes_per_rank=322560, slot_bytes=46080, alone=2, burst=8, rounds=1,
                duration=20.0)  # fmt: skip
    return SimpleNamespace(**{**args, **over})


def test_every_configuration_serves_every_request_and_no_cache_waits_for_more_loads():
    sim = Sim(sim_args(), StepModel(), link_gbps=1.0, cache_bytes=82_575_360)
    trace = [entry(30 + 7 * i, 10, 3.0 * i, ("r8-0", "r128-1")[i % 2]) for i in range(10)]
    waits = {}
    for name in SIM_CONFIGS:
        limits = sim.limits(name)
        assert limits.cache.keep_idle is SIM_CONFIGS[name].adapter_cache
        assert limits.cache.stall_for_load is (SIM_CONFIGS[name].lora_mode == "on-demand-sync")
        seqs = run(sim.policy(name, 5000.0), limits, trace, sim.steps)
        assert all(s.finished and s.first_token_s is not None for s in seqs)
        waits[name] = sum(s.first_token_s - s.arrival for s in seqs)
    # Each request runs alone: without a cache every one waits for its load, with it two do.
    assert waits["slora"] > waits["chameleon-nosched"] + 8 * 0.02
    assert waits["chameleon-nocache"] == pytest.approx(waits["slora"])
    assert waits["slora-sync"] == pytest.approx(waits["slora"])  # alone, no one else waits


def test_a_run_in_which_nothing_can_ever_run_again_ends_as_stalled_and_counts_its_unserved():
    """Requests wait, nothing runs, no arrival or load is to come: the real engine would wait for
    ever, and the sim says so (Stalled) instead of looping; its summary counts the unserved as
    never served (the P99 they reach is None)."""
    from bench.queueing_sim import summarise
    from bench.sim_engine import Stalled

    class Never(FcfsQueue):
        def select(self, gate, running, now):
            return []

    limits = SimLimits(4096, 8, 8192, {"a": 4}, budget=StepBudget(256, 0.0, "test"))
    trace = [entry(20, 4, 0.0, "a"), entry(20, 4, 1.0, "a")]
    with pytest.raises(Stalled) as stalled:
        run(Never(SchedulingConfig(), 4096), limits, trace, StepModel())
    assert stalled.value.now == 1.0
    served = run(FcfsQueue(SchedulingConfig(), 4096), limits, trace, StepModel())
    row = summarise([served, stalled.value.seqs], slo_ms=5000.0, num_stalled=1)
    assert row["num_unserved"] == 2 and row["num_stalled_runs"] == 1
    assert row["ttft_p99_ms"] is None and row["ttft_p50_ms"] is None
    assert row["slo_attainment"] == 0.5
