"""The simulator's prefix caches: a conversation's later turn prefills only what its server does
not hold, so prefix-aware routing finds more of its prompts cached, and its later turns' first
tokens come sooner, than rank-aware routing over the same trace."""

from __future__ import annotations

from toppings.scheduler.perf_model import LinearPerfModel, PerfModels
from toppings.scheduler.policies import make_policy
from toppings.scheduler.sim.prefix_cache import SimPrefixCaches
from toppings.scheduler.sim.simulator import SimConfig, simulate
from toppings.scheduler.sim.trace import TraceRequest, conversation_trace


def perf() -> PerfModels:
    models = {}
    for kernel in ("bgmv", "mbgmv"):
        models[f"{kernel}_decode"] = LinearPerfModel(kernel, "decode", 20.0, (0.05,))
        models[f"{kernel}_prefill"] = LinearPerfModel(kernel, "prefill", 5.0, (0.5, 0.001))
    return PerfModels(models, source="test")


def trace() -> list[TraceRequest]:
    adapters = {f"a{i}": 8 for i in range(16)}
    return conversation_trace(32, 4, 2000, 100, 16, duration_s=20.0, think_s=3.0,
                              adapters=adapters, seed=1)  # fmt: skip


def run(policy_name: str) -> tuple[dict, list]:
    caches = SimPrefixCaches(capacity_tokens=40_000)
    options = {"prefix": caches} if policy_name == "prefix-aware" else {}
    policy = make_policy(policy_name, perf(), 1000.0, **options)
    config = SimConfig(num_servers=4, warmup_fraction=0.0)
    result = simulate(trace(), policy, perf(), config, prefix=caches)
    later = [r for r in result.requests if r.trace.prefix_tokens > 0]
    return result.summary(1000.0), later


def test_conversation_trace_shares_each_previous_prompt_and_answer():
    turns = [r for r in trace() if r.prefix_id == 3]
    assert [r.prompt_tokens for r in turns] == [2000, 2116, 2232, 2348]
    assert [r.prefix_tokens for r in turns] == [0, 2016, 2132, 2248]


def test_prefix_aware_routing_finds_more_cached_and_answers_later_turns_sooner():
    aware, aware_later = run("prefix-aware")
    blind, blind_later = run("rank-aware")
    assert aware["prefix_hit_rate"] > 0.6 > blind["prefix_hit_rate"]

    def found(requests) -> float:  # later turns that found their previous prompt cached
        return sum(r.cached_tokens >= r.trace.prefix_tokens - 16 for r in requests) / len(requests)

    assert found(aware_later) > 0.8 > 0.4 > found(blind_later)

    def mean_ttft(requests) -> float:
        return sum(r.first_token_s - r.trace.arrival_s for r in requests) / len(requests)

    assert mean_ttft(aware_later) < mean_ttft(blind_later)


def test_a_full_cache_forgets_the_least_recent_conversation():
    caches = SimPrefixCaches(capacity_tokens=3000)
    first, second = (TraceRequest(i, 0.0, "a", 8, 2000, 1, i, 0) for i in range(2))
    caches.store("s", first)
    caches.store("s", second)
    key = SimPrefixCaches.key(TraceRequest(2, 1.0, "a", 8, 2100, 1, 0, 2000))
    assert caches.matched_tokens(key, ["s"]) == {"s": 0}
    key = SimPrefixCaches.key(TraceRequest(3, 1.0, "a", 8, 2100, 1, 1, 2000))
    assert caches.matched_tokens(key, ["s"]) == {"s": 2000}
