"""Prefix-aware routing: the rank-aware cost plus what each server has cached of the prompt."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from toppings.scheduler.kv_index.prefix_key import PrefixKey
from toppings.scheduler.policies.base import candidates
from toppings.scheduler.policies.rank_aware import RankAware
from toppings.scheduler.state import RouteRequest, ServerState


class PrefixSource(Protocol):
    """Where prefix-aware routing learns what each server holds of a prompt: the scheduler's
    KV events index (scheduler/kv_index/feeds.py) or the simulator's caches."""

    def matched_tokens(self, key: PrefixKey, urls: Iterable[str]) -> Mapping[str, int | None]:
        """Per server url: leading tokens of `key` whose KV it holds; None: unknown (stale)."""


@dataclass(frozen=True)
class PrefixWeights:
    """The weights of prefix-aware routing's score (PrefixAware), in one place. Each term is in
    milliseconds of predicted latency, so a weight of 1 takes a term at its face value.

    load: the rank-aware total (Algorithm 1: the delay the request adds to each request already
    on the server, times their number); prefill: the request's own prefill, queued behind the
    server's pending prefills; prefix: the prefill the server's cached prefix saves it (0: the
    index is ignored, the score of a router without events)."""

    load: float = 1.0
    prefill: float = 1.0
    prefix: float = 1.0

    def __post_init__(self) -> None:
        if min(self.load, self.prefill, self.prefix) < 0:
            raise ValueError("prefix-aware weights must not be negative")


class PrefixAware(RankAware):
    """Rank-aware routing that also counts what each server has cached of the prompt.

    score = w.load * (Algorithm 1's total, as RankAware)
          + w.prefill * Prefill(queue + the whole prompt)
          - w.prefix * (Prefill(queue + the whole prompt) - Prefill(queue + what is not cached))

    with Prefill the server kernel's prefill perf model, "what is not cached" the prompt less
    the longest prefix the server holds (`PrefixSource`; an unknown match counts as nothing
    cached), and the weights in `PrefixWeights`. Lowest score first; then, as RankAware, the
    adapter's residency (device, loading, host, not held), the unweighted cost and the
    predicted decode latency; a server past the decode SLO goes last (+inf).

    Why an own-prefill term: Algorithm 1's total is 0 on an idle server (nobody is delayed), so
    without a term for the request's own latency a busy server that holds a conversation's
    2,000 tokens would always lose to an idle one that must compute them. The own prefill is
    the same on every idle server, so without a cached prefix the order is RankAware's but for
    the queue's pending prefills (which RankAware charges only through the total).
    """

    name = "prefix-aware"

    def __init__(
        self,
        *args: Any,
        prefix: PrefixSource | None = None,
        weights: PrefixWeights | None = None,
        **kwargs: Any,
    ):
        """prefix: what servers hold (None: nothing is ever known, the score has no prefix
        term); weights: PrefixWeights() by default."""
        super().__init__(*args, **kwargs)
        self.prefix = prefix
        self.weights = weights or PrefixWeights()
        self._last_matched: tuple[RouteRequest | None, Mapping[str, int | None]] = (None, {})

    def order(self, request: RouteRequest, servers: Sequence[ServerState]) -> list[int]:
        served = candidates(request, servers)
        matched: Mapping[str, int | None] = {}
        if self.prefix is not None and request.prefix is not None and served:
            matched = self.prefix.matched_tokens(request.prefix, [servers[i].url for i in served])
        self._last_matched = (request, matched)
        keyed = [(self._score(request, servers[i], matched.get(servers[i].url)), i) for i in served]
        keyed.sort()
        return [i for _, i in keyed]

    def choose(self, request: RouteRequest, servers: Sequence[ServerState]) -> int | None:
        ranked = self.order(request, servers)
        return ranked[0] if ranked else None

    def routed_as(self, request: RouteRequest, url: str) -> RouteRequest:
        """With only what `url` does not hold left to prefill: a request just routed to the
        holder of its prefix must not look, until the next /stats, like a whole prompt of
        pending prefill there (the next turn of its conversation would then be sent away).
        Reads the matches of the last `order` (the router ranks and notes under one lock)."""
        last, matched = self._last_matched
        cached = matched.get(url) if last is request else None
        if not cached:
            return request
        return replace(request, prompt_tokens=max(1, request.prompt_tokens - cached))

    def _score(
        self, request: RouteRequest, server: ServerState, matched: int | None
    ) -> tuple[float, int, float, float]:
        total, residency, cost, decode_after = self._key(request, server)
        if math.isinf(total):
            return total, residency, cost, decode_after
        prefill = self.perf.prefill(server.kernel)
        whole = prefill.predict(server.queue.add(request.rank, request.prompt_tokens))
        cached = min(matched or 0, request.prompt_tokens - 1)
        rest = prefill.predict(server.queue.add(request.rank, request.prompt_tokens - cached))
        w = self.weights
        score = w.load * total + w.prefill * whole - w.prefix * (whole - rest)
        return score, residency, cost, decode_after
