"""Synthetic request traces for the cluster simulator.

Arrivals are Poisson. Adapter popularity follows a power law over adapters (Zipf, exponent
`zipf_s`), the shape of the Azure Functions (MAF) invocation counts the paper scales: a few
functions take most calls, a long tail is called rarely. Each adapter has one rank, drawn
uniformly from `ranks` with the seed. Prompt and output lengths are lognormal with the means
LMSYS-Chat-1M reports (69.5 tokens per prompt, 214.5 per response); the dataset paper gives no
spread, so sigma = 1.0 (a median about 0.6x the mean, a long right tail as in chat logs) is our
choice. Lengths are clipped to [1, max_*_tokens].

Drift (`drift_per_s` > 0): the popularity order slides along the adapters by that many places
per second, continuously: a request drawn at Zipf position p at time t goes to adapter
floor(t x drift_per_s + p + U) mod num_adapters, U uniform in [0, 1), so each adapter's share
moves linearly from one position's weight to the next's instead of jumping; an adapter climbs
to the head, then its share falls to nothing over 1 / drift_per_s seconds (the MAF trace's
drifting function popularity; LoRAServe's Fig. 10). Each adapter keeps its rank, so the rank
mix of the hot set drifts with it. The default 0 is a fixed popularity (and the same traces as
before drift existed).

Defaults: 40,000 adapters, as the paper's 60-instance simulation has 40,000 MAF functions;
zipf_s = 1.1 puts ~14% of requests on the most popular adapter and ~60% on the top 100. The
MAF statistic "18.6% of functions take 99.6% of calls" would need s ~ 1.5, which gives one
adapter (hence one rank) 38% of all requests and leaves little rank mix to schedule.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class TraceConfig:
    rps: float = 340.0
    duration_s: float = 60.0
    num_adapters: int = 40_000
    zipf_s: float = 1.1
    ranks: tuple[int, ...] = (8, 16, 32, 64)
    prompt_mean: float = 69.5
    prompt_sigma: float = 1.0
    max_prompt_tokens: int = 2048
    output_mean: float = 214.5
    output_sigma: float = 1.0
    max_output_tokens: int = 1024
    seed: int = 0
    drift_per_s: float = 0.0

    def __post_init__(self) -> None:
        if self.rps <= 0 or self.duration_s <= 0 or self.num_adapters < 1 or not self.ranks:
            raise ValueError("rps, duration_s and num_adapters must be positive, ranks non-empty")
        if self.drift_per_s < 0:
            raise ValueError("drift_per_s must be >= 0")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request; a conversation's (prefix_id >= 0) shares its first prefix_tokens tokens
    with that conversation's earlier turns (scheduler/sim/prefix_cache.py)."""

    idx: int
    arrival_s: float
    adapter: str
    rank: int
    prompt_tokens: int
    output_tokens: int
    prefix_id: int = -1
    prefix_tokens: int = 0


def lognormal_mu(mean: float, sigma: float) -> float:
    """mu of a lognormal with the given mean: mean = exp(mu + sigma^2 / 2)."""
    return math.log(mean) - sigma * sigma / 2.0


def adapter_ranks(config: TraceConfig) -> list[int]:
    """Rank of each adapter, by index (without drift, index 0 is the most popular)."""
    rng = random.Random(config.seed * 7919 + 1)
    return [rng.choice(config.ranks) for _ in range(config.num_adapters)]


def generate_trace(config: TraceConfig) -> list[TraceRequest]:
    """Requests sorted by arrival; the same config always gives the same trace."""
    rng = random.Random(config.seed)
    ranks = adapter_ranks(config)
    cum_weights = list(
        itertools.accumulate(1.0 / (i**config.zipf_s) for i in range(1, config.num_adapters + 1))
    )
    total = cum_weights[-1]
    prompt_mu = lognormal_mu(config.prompt_mean, config.prompt_sigma)
    output_mu = lognormal_mu(config.output_mean, config.output_sigma)
    requests: list[TraceRequest] = []
    now = rng.expovariate(config.rps)
    while now < config.duration_s:
        adapter_idx = bisect.bisect_left(cum_weights, rng.random() * total)
        if config.drift_per_s:  # position + U in [p, p + 1), shifted by the drift so far
            shifted = now * config.drift_per_s + adapter_idx + rng.random()
            adapter_idx = int(shifted) % config.num_adapters
        prompt = int(round(rng.lognormvariate(prompt_mu, config.prompt_sigma)))
        output = int(round(rng.lognormvariate(output_mu, config.output_sigma)))
        requests.append(
            TraceRequest(
                idx=len(requests),
                arrival_s=now,
                adapter=f"lora-{adapter_idx}",
                rank=ranks[adapter_idx],
                prompt_tokens=min(max(prompt, 1), config.max_prompt_tokens),
                output_tokens=min(max(output, 1), config.max_output_tokens),
            )
        )
        now += rng.expovariate(config.rps)
    return requests


def trace_summary(requests: list[TraceRequest]) -> dict[str, object]:
    """What a result file should say about the trace it ran."""
    num = len(requests)
    if num == 0:
        return {"num_requests": 0}
    by_rank: dict[int, int] = {}
    by_adapter: dict[str, int] = {}
    for r in requests:
        by_rank[r.rank] = by_rank.get(r.rank, 0) + 1
        by_adapter[r.adapter] = by_adapter.get(r.adapter, 0) + 1
    top = sorted(by_adapter.values(), reverse=True)
    return {
        "num_requests": num,
        "mean_prompt_tokens": sum(r.prompt_tokens for r in requests) / num,
        "mean_output_tokens": sum(r.output_tokens for r in requests) / num,
        "request_share_by_rank": {str(k): v / num for k, v in sorted(by_rank.items())},
        "num_adapters_used": len(by_adapter),
        "share_top1_adapter": top[0] / num,
        "share_top100_adapters": sum(top[:100]) / num,
    }


def conversation_trace(
    num_conversations: int,
    turns: int,
    context_tokens: int,
    turn_tokens: int,
    output_tokens: int,
    duration_s: float,
    think_s: float,
    adapters: dict[str, int],
    seed: int = 0,
) -> list[TraceRequest]:
    """Multi-turn conversations: each starts at a uniform time in [0, duration_s) under one
    adapter (in turn from `adapters`, name -> rank), its first prompt `context_tokens` long;
    turn t arrives `think_s` after turn t - 1 and its prompt is the previous one plus its
    answer and `turn_tokens` more, the previous prompt and answer being its shared prefix."""
    rng = random.Random(seed)
    names = sorted(adapters)
    items = []
    for c in range(num_conversations):
        start = rng.uniform(0.0, duration_s)
        adapter = names[c % len(names)]
        prompt, shared = context_tokens, 0
        for t in range(turns):
            items.append((start + t * think_s, c, adapter, prompt, shared))
            shared = prompt + output_tokens
            prompt = shared + turn_tokens
    items.sort()
    return [
        TraceRequest(i, at, adapter, adapters[adapter], prompt, output_tokens, c, shared)
        for i, (at, c, adapter, prompt, shared) in enumerate(items)
    ]
