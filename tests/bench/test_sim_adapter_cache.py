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


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def cache_of(keep_idle: bool, budget: int = 300) -> tuple[SimAdapterCache, Clock]:
    clock = Clock()
    link = SimLink(gbps=8e-9 * 100, latency_s=0.0)  # 100 bytes a second
    ranks = {"a": 1, "b": 1, "c": 2}
    return SimAdapterCache(ranks, 100, budget, link, make_policy("lru"), keep_idle, clock), clock


def test_loads_run_one_after_another_and_a_request_starts_once_its_load_landed():
    cache, clock = cache_of(keep_idle=True)
    a, b = cache.acquire("a", frozenset()), cache.acquire("b", frozenset())
    assert (a.ready_s, b.ready_s) == pytest.approx((1.0, 2.0))
    assert not cache.may_start(b) and cache.next_ready_s() == pytest.approx(1.0)
    clock.now = 2.0
    assert cache.may_start(a) and cache.may_start(b) and cache.next_ready_s() is None


def test_without_a_cache_an_adapter_leaves_with_its_last_request_and_is_loaded_again():
    for keep_idle, loads in ((False, 2), (True, 1)):
        cache, clock = cache_of(keep_idle)
        cache.acquire("a", frozenset())
        clock.now = 5.0
        cache.release("a")
        assert ("a" in cache.entries) is keep_idle
        cache.acquire("a", frozenset())
        assert cache.num_loads == loads


def test_the_budget_evicts_idle_adapters_and_waits_when_all_are_held():
    cache, clock = cache_of(keep_idle=True, budget=300)
    cache.acquire("a", frozenset())
    cache.acquire("b", frozenset())
    assert cache.acquire("c", frozenset()) is None  # 200 more bytes: both others are held
    clock.now = 10.0
    cache.release("a")
    assert cache.fits_if_released("c", "b") is False  # a's release already made the room
    assert cache.acquire("c", frozenset()) is not None and "a" not in cache.entries


def test_nothing_is_prefetched_without_a_cache():
    for keep_idle in (False, True):
        cache, _ = cache_of(keep_idle)
        cache.prefetch(["a"], frozenset())
        assert ("a" in cache.entries) is keep_idle


def entry(prompt: int, out: int, at: float, adapter: str) -> SimpleNamespace:
    return SimpleNamespace(prompt=[0] * prompt, max_tokens=out, arrival_s=at, model=adapter)


def test_a_request_gets_its_first_token_only_after_its_adapter_crossed_the_link():
    cache = SimCache(budget_bytes=10_000, bytes_per_rank=1000, slot_bytes=10, link_gbps=8e-6)
    limits = SimLimits(4096, 8, 8192, {"a": 4}, max_step_tokens=256, cache=cache)
    policy = FcfsQueue(SchedulingConfig(), 4096)
    (seq,) = run(policy, limits, [entry(20, 4, 0.0, "a")], StepModel())
    assert seq.first_token_s >= 4.0  # 4000 bytes at 1000 bytes a second
    assert seq.finish_s > seq.first_token_s


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
        seqs = run(sim.policy(name, 5000.0), limits, trace, sim.steps)
        assert all(s.finished and s.first_token_s is not None for s in seqs)
        waits[name] = sum(s.first_token_s - s.arrival for s in seqs)
    # Each request runs alone: without a cache every one waits for its load, with it two do.
    assert waits["slora"] > waits["chameleon-nosched"] + 8 * 0.02
    assert waits["chameleon-nocache"] == pytest.approx(waits["slora"])


def test_a_request_takes_adapter_memory_that_waiting_requests_hold_for_landed_loads():
    """The admission gate (server/sched/admission.py) releases what waiting requests hold from
    an earlier NOT_READY once their loads landed, when the request it asks about finds no
    adapter memory: a policy that stopped at that request would otherwise wait for requests it
    never asks again, with nothing running."""
    from bench.sim_engine import SimSeq, SimStaticMemory
    from toppings.server.sched.admission import AdmissionGate, GateLimits
    from toppings.server.sched.queueing import Verdict

    cache, clock = cache_of(keep_idle=True, budget=300)
    spec = SimCache(budget_bytes=300, bytes_per_rank=100, slot_bytes=10, link_gbps=1.0)
    memory = SimStaticMemory(1000, cache, spec)
    held = [SimSeq(10, 4, 0.0, "a"), SimSeq(10, 4, 0.0, "b")]
    head = SimSeq(10, 4, 0.0, "c")  # rank 2: 200 bytes, with a and b held only 100 are free
    waiting = [head, *held]
    gate = AdmissionGate([], waiting, memory, cache, GateLimits(8, 8192), clock)
    assert [gate.try_admit(s) for s in held] == [Verdict.NOT_READY] * 2  # loads started
    gate = AdmissionGate([], waiting, memory, cache, GateLimits(8, 8192), clock)
    assert gate.try_admit(head) is Verdict.NO_ADAPTER_MEMORY  # a and b still crossing
    clock.now = 10.0  # both landed
    assert gate.try_admit(head) in (Verdict.NOT_READY, Verdict.ADMITTED)
    assert head.cache_entry is not None and all(s.cache_entry is None for s in held)


def test_chameleon_serves_a_trace_on_which_waiting_holds_once_stalled_it():
    """A 600 s trace at 1.38 req/s on which the chameleon configuration stopped with nothing
    running and 24 requests waiting (a reserved head needed adapter memory that requests
    behind it held), before the gate released such holds."""
    args = sim_args(per_rank=4, max_prompt_len=512, output_len="lognormal:40:1.0",
                    max_output_len=256, max_total_tokens=2048, max_batch_size=32)  # fmt: skip
    sim = Sim(args, StepModel(), link_gbps=1.0372485868609471, cache_bytes=82575360)
    from bench.bench_queueing import trace_for

    trace = trace_for(args, sim.ranks, 1.38, 100 + 1380, 600)
    seqs = sim.run("chameleon", trace, 8138.3)
    assert all(s.finished for s in seqs)
