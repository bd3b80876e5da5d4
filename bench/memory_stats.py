"""The arithmetic of bench_memory: per-turn records -> TTFT, time per token, hit rates, ratios.

A record is one turn of one conversation, as the driver writes it: `conv`, `turn` (0 for the
first), `adapter`, `prompt_tokens`, `output_tokens`, `ttft_s`, `e2e_s`, and `sent_s` / `end_s`
(seconds from the start of the run). Pure functions, no model: tested in
tests/bench/test_bench_memory.py.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from toppings.scripts.loadgen.stats import percentile

HEADLINE_FIELDS = (  # metric key stem -> summary field
    ("ttft_p50", "ttft_p50_ms"),
    ("ttft_p99", "ttft_p99_ms"),
    ("ttft_p50_turn2plus", "ttft_p50_ms_turn2plus"),
    ("ttft_p99_turn2plus", "ttft_p99_ms_turn2plus"),
    ("tpt", "tpt_mean_ms"),
    ("throughput", "output_tokens_per_s"),
)
# Numbers of the engine's memory view that are sizes or levels, not counters: no delta.
MEMORY_GAUGES = ("block_tokens", "block_bytes", "reserved_blocks", "committed_blocks")
CAPACITY_SHARE = 0.75  # capacity: completions per second until 75% of a burst has completed


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing or den is 0."""
    if num is None or den is None or den == 0:
        return None
    return num / den


def time_per_token_s(record: dict) -> float | None:
    """(E2E - TTFT) / (output tokens - 1): the mean gap between a turn's tokens; None for one."""
    if record["output_tokens"] < 2:
        return None
    return (record["e2e_s"] - record["ttft_s"]) / (record["output_tokens"] - 1)


def summarise(runs: Sequence[Sequence[dict]]) -> dict:
    """Pooled over runs: TTFT p50 / p99 (ms) of all turns and of turns >= 2, mean time per
    token (ms), output tokens per second (over the runs' summed spans)."""
    records = [r for run in runs for r in run]
    ttft = [1000 * r["ttft_s"] for r in records]
    later = [1000 * r["ttft_s"] for r in records if r["turn"] >= 1]
    tpt = [t for t in map(time_per_token_s, records) if t is not None]
    span = sum(max((r["end_s"] for r in run), default=0.0) for run in runs)
    output_tokens = sum(r["output_tokens"] for r in records)
    return {
        "num_turns": len(records),
        "num_conversations": len({(i, r["conv"]) for i, run in enumerate(runs) for r in run}),
        "ttft_p50_ms": percentile(ttft, 50) if ttft else None,
        "ttft_p99_ms": percentile(ttft, 99) if ttft else None,
        "ttft_mean_ms": statistics.fmean(ttft) if ttft else None,
        "ttft_p50_ms_turn2plus": percentile(later, 50) if later else None,
        "ttft_p99_ms_turn2plus": percentile(later, 99) if later else None,
        "tpt_mean_ms": 1000 * statistics.fmean(tpt) if tpt else None,
        "output_tokens_per_s": output_tokens / span if span else None,
        "prompt_tokens": sum(r["prompt_tokens"] for r in records),
        "output_tokens": output_tokens,
    }


def counter_delta(before: dict, after: dict) -> dict:
    """What one run added to an engine's counters: adapter hits and misses, and the memory
    pool's counters (prefix_hit_tokens, prompt_tokens, swaps, evictions, ...) when it has them,
    with its blocks by kind at the end of the run."""
    cache_a, cache_b = after["adapter_cache"], before["adapter_cache"]
    delta = {k: cache_a[k] - cache_b[k] for k in ("hits", "misses", "loads", "evictions")}
    memory_a, memory_b = after.get("memory"), before.get("memory")
    if isinstance(memory_a, dict) and isinstance(memory_b, dict):
        delta["memory"] = {
            k: v - memory_b.get(k, 0)
            for k, v in memory_a.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in MEMORY_GAUGES
        }
        delta["memory"]["blocks_at_end"] = memory_a.get("blocks")
    else:
        delta["memory"] = None
    return delta


def hit_rates(deltas: Sequence[dict]) -> dict:
    """Adapter hit rate hits / (hits + misses) and prefix-hit rate prefix-reused prompt tokens /
    prompt tokens, summed over runs; a rate is None when the engine does not count it."""
    hits = sum(d["hits"] for d in deltas)
    misses = sum(d["misses"] for d in deltas)
    memory = [d["memory"] for d in deltas]
    prefix = None
    if memory and all(m is not None and "prefix_hit_tokens" in m for m in memory):
        reused = sum(m["prefix_hit_tokens"] for m in memory)
        prefix = ratio(reused, sum(m.get("prompt_tokens", 0) for m in memory))
    return {"adapter_hit_rate": ratio(hits, hits + misses), "prefix_hit_rate": prefix}


def config_summary(runs: Sequence[tuple[list[dict], dict]]) -> dict:
    """One config's (records, counter delta) per round -> pooled summary, hit rates, per round."""
    return {
        **summarise([r for r, _ in runs]),
        **hit_rates([d for _, d in runs]),
        "per_round": [{**summarise([r]), **hit_rates([d])} for r, d in runs],
        "memory_counters_per_round": [d["memory"] for _, d in runs],
    }


def headline(per_config: dict[str, dict]) -> dict:
    """Ratios against `static` (pooled, and per round for the spread): `pool_prefix`'s unprefixed
    (ttft_p50_ratio_vs_static, ...), `pool`'s with `pool_`; and pool_prefix's prefix_hit_rate."""
    metrics: dict = {}
    static = per_config.get("static")
    for name, prefix in (("pool_prefix", ""), ("pool", "pool_")):
        ours = per_config.get(name)
        if ours is None or static is None:
            continue
        for key, field in HEADLINE_FIELDS:
            metrics[f"{prefix}{key}_ratio_vs_static"] = ratio(ours[field], static[field])
            metrics[f"{prefix}{key}_ratio_vs_static_per_round"] = [
                ratio(a[field], b[field]) for a, b in zip(ours["per_round"], static["per_round"])
            ]
    if "pool_prefix" in per_config:
        metrics["prefix_hit_rate"] = per_config["pool_prefix"]["prefix_hit_rate"]
    return metrics


def burst_capacity(records: Sequence[dict], share: float = CAPACITY_SHARE) -> float:
    """Conversations per second while a burst (all started at 0) still saturates the engine:
    the first `share` of the conversations to end over the time the last of them took (the
    burst's tail runs unsaturated). A conversation ends when its last turn does."""
    ends: dict[int, float] = {}
    for r in records:
        ends[r["conv"]] = max(ends.get(r["conv"], 0.0), r["end_s"])
    done = sorted(ends.values())
    k = max(1, int(share * len(done)))
    return k / done[k - 1]


def peak_open_tokens(records: Sequence[dict]) -> int:
    """The most KV tokens the open conversations hold at once: a conversation is open from its
    first turn's send to its last turn's end and holds its final context (prompt + output of
    its last turn) all along: an upper bound of what a prefix cache would keep for it."""
    spans: dict[int, list[float]] = {}
    for r in records:
        first, last, size = spans.get(r["conv"], (r["sent_s"], r["end_s"], 0))
        span = (min(first, r["sent_s"]), max(last, r["end_s"]))
        spans[r["conv"]] = [*span, max(size, r["prompt_tokens"] + r["output_tokens"])]
    starts = sorted(first for first, _, _ in spans.values())
    return max(
        (sum(size for first, last, size in spans.values() if first <= t < last) for t in starts),
        default=0,
    )
