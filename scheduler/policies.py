"""Routing policies: pick a server for a request from the servers' states.

Every policy answers `order(request, servers)`: the indices of the servers that can take the
request (healthy, same base model, hosting the adapter), best first, so a caller can fall back
to the next one when a server fails. `choose` is the first of that order. Policies are picked by
name from POLICIES; the scheduler and the simulator run the same objects. `tick(now_s, servers,
adapters)` is called periodically by both (the placement of `loraserve` runs there).
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol

from toppings.scheduler.kv_index.prefix_key import PrefixKey
from toppings.scheduler.loraserve import PlacementConfig, Placer
from toppings.scheduler.perf_model import PerfModels
from toppings.scheduler.state import RouteRequest, ServerState

DEFAULT_AVG_RESP_LEN = 128.0


class Policy(ABC):
    """One routing rule. `slo_ms` bounds the predicted decode iteration latency (TPT)."""

    name: ClassVar[str]

    def __init__(
        self,
        perf: PerfModels,
        slo_ms: float,
        avg_resp_len: float = DEFAULT_AVG_RESP_LEN,
        seed: int = 0,
    ) -> None:
        if slo_ms <= 0 or avg_resp_len <= 0:
            raise ValueError("slo_ms and avg_resp_len must be positive")
        self.perf = perf
        self.slo_ms = slo_ms
        # Updated by the scheduler as responses come back (a float store is atomic in CPython).
        self.avg_resp_len = avg_resp_len
        self.seed = seed

    @abstractmethod
    def order(self, request: RouteRequest, servers: Sequence[ServerState]) -> list[int]:
        """Indices of the servers that serve `request`, best first."""

    def choose(self, request: RouteRequest, servers: Sequence[ServerState]) -> int | None:
        """Index of the best server, or None when no server serves the request."""
        ranked = self.order(request, servers)
        return ranked[0] if ranked else None

    def tick(
        self,
        now_s: float,
        servers: Sequence[ServerState],
        adapters: Mapping[str, int] | None = None,
    ) -> None:
        """Periodic hook (every /stats refresh): `now_s` on a monotonic clock, the servers'
        states, every known adapter (name -> rank). Routing-only policies ignore it."""
        return None

    def holdings(self) -> tuple[int, Mapping[str, frozenset[str]]] | None:
        """What a placing policy assigned to each server: (version, server url -> adapters),
        the version changing with each new placement; None for routing-only policies. The
        simulator has servers prefetch and keep these adapters (scheduler/sim/adapter_pool.py)."""
        return None

    def routed_as(self, request: RouteRequest, url: str) -> RouteRequest:
        """`request` as the server at `url` will run it, for the scheduler to count among that
        server's queued requests until its next /stats (the same request, unless the policy
        knows the server holds part of its prompt)."""
        return request

    def decode_after(self, request: RouteRequest, server: ServerState) -> float:
        """Predicted decode iteration latency (ms) of `server` once `request` joins its batch."""
        batch = server.batch.add(request.rank, request.prompt_tokens)
        return self.perf.decode(server.kernel).predict(batch)


def candidates(request: RouteRequest, servers: Sequence[ServerState]) -> list[int]:
    return [idx for idx, server in enumerate(servers) if server.serves(request)]


class KeyedPolicy(Policy):
    """A policy that ranks the servers serving a request by a sort key (lowest first, ties by
    server order)."""

    @abstractmethod
    def _key(self, request: RouteRequest, server: ServerState) -> tuple:
        """Sort key of a server that serves the request."""

    def order(self, request: RouteRequest, servers: Sequence[ServerState]) -> list[int]:
        keyed = [(self._key(request, servers[i]), i) for i in candidates(request, servers)]
        keyed.sort()
        return [i for _, i in keyed]

    def choose(self, request: RouteRequest, servers: Sequence[ServerState]) -> int | None:
        best = min(
            ((self._key(request, s), i) for i, s in enumerate(servers) if s.serves(request)),
            default=None,
        )
        return None if best is None else best[1]


class RankAware(KeyedPolicy):
    """Toppings Algorithm 1.

    For each server: cost = dPrefill(queue + req) / avg_resp_len + dDecode(running + queue + req),
    where d is the predicted increase over the set without req (an empty set costs 0: no iteration
    runs); cost is +inf when Decode(running + queue + req) > SLO; total = cost * (running + queue).

    Among servers of equal total, the one where the request's adapter already is goes first: on
    the device, then loading there, then in host memory only, then one that must fetch it
    (`ServerState.residency`, from each server's `/stats`): a load costs the request a cold
    start and the device memory another adapter's eviction, which the cost model does not see.

    Empty server: the product is 0, and we keep it. The product charges the request's delay to
    every request already there; on an empty server nobody is delayed, so 0 is the right price
    and an idle server wins. Ties (several empty servers, or every server over the SLO) are broken
    by the adapter's residency, then by the unweighted cost, then by the predicted decode latency
    with the request (the least SLO violation when all are +inf), then by server order. inf * 0
    would be nan, so an over-SLO server gets total = +inf directly.
    """

    name = "rank-aware"

    def _key(self, request: RouteRequest, server: ServerState) -> tuple[float, int, float, float]:
        decode = self.perf.decode(server.kernel)
        batch_after = server.batch.add(request.rank, request.prompt_tokens)
        decode_after = decode.predict(batch_after)
        residency = server.residency(request.adapter)
        if decode_after > self.slo_ms:
            return math.inf, residency, math.inf, decode_after
        prefill = self.perf.prefill(server.kernel)
        queue_after = server.queue.add(request.rank, request.prompt_tokens)
        d_prefill = prefill.predict(queue_after) - prefill.predict(server.queue)
        d_decode = decode_after - decode.predict(server.batch)
        cost = d_prefill / self.avg_resp_len + d_decode
        return cost * server.num_requests, residency, cost, decode_after


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


class RandomPolicy(Policy):
    """Uniformly random among the servers that serve the request; seeded, so runs repeat."""

    name = "random"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rng = random.Random(self.seed)

    def order(self, request: RouteRequest, servers: Sequence[ServerState]) -> list[int]:
        ranked = candidates(request, servers)
        self.rng.shuffle(ranked)
        return ranked

    def choose(self, request: RouteRequest, servers: Sequence[ServerState]) -> int | None:
        ranked = candidates(request, servers)
        return self.rng.choice(ranked) if ranked else None


class FirstFit(Policy):
    """Punica-style consolidation: the first server, in the fixed server order, with room.

    Room: the KV slots left after the queue's reservations hold the request's prompt and
    max_new_tokens, and the predicted decode latency with the request stays within the SLO.
    When no server has room, the rest follow by predicted decode latency (least violation first).
    """

    name = "first-fit"

    def _fits(self, request: RouteRequest, server: ServerState) -> bool:
        need = request.prompt_tokens + request.max_new_tokens
        return server.room_tokens >= need and self.decode_after(request, server) <= self.slo_ms

    def order(self, request: RouteRequest, servers: Sequence[ServerState]) -> list[int]:
        served = candidates(request, servers)
        fitting = [i for i in served if self._fits(request, servers[i])]
        fitting_set = set(fitting)
        rest = [i for i in served if i not in fitting_set]
        rest.sort(key=lambda i: (self.decode_after(request, servers[i]), i))
        return fitting + rest

    def choose(self, request: RouteRequest, servers: Sequence[ServerState]) -> int | None:
        for idx, server in enumerate(servers):
            if server.serves(request) and self._fits(request, server):
                return idx
        ranked = self.order(request, servers)
        return ranked[0] if ranked else None


class LeastLoaded(KeyedPolicy):
    """dLoRA-style balancing: fewest running + queued requests, ties by lower predicted latency."""

    name = "least-loaded"

    def _key(self, request: RouteRequest, server: ServerState) -> tuple[int, float]:
        return server.num_requests, self.decode_after(request, server)


class LoRAServe(RankAware):
    """LoRAServe on Toppings' cost: the placement (scheduler/placement.py) decides which servers
    hold and keep which adapters, and LoRAServe's operating points bound each server's load.

    Among the servers that hold the request's adapter, those that stay within their operating
    point with the request go first, each group by the rank-aware cost. Only servers that hold
    the adapter are candidates (as for every policy; the scheduler's adapter sync has the
    servers of a new row fetch it from a peer, scheduler/adapter_sync.py), unless none does:
    then the row's servers are, and fetch it when asked. (In the simulator with an adapter
    store, every server counts as holding every adapter and pays the fetch on a miss.)

    Past the operating point (`_over`): with the request, the server would hold more requests
    (running + queued) than the batch at which it delivers the operating point of the rank its
    batch pads to (`Placer.batch_limit`: by the model of scheduler/operating_points.py and
    Little's law, the batch size whose throughput equals the operating point, profiled or
    derived). The rank-aware cost alone (decode iteration > SLO) fires far later: a rank-8
    batch never gets there within 128 requests. The bound also separates ranks where it pays:
    once the servers that pad to rank 64 hold what rank 64 sustains, a rank-8 request goes to
    one that does not pad, whose bound is higher.

    Why the row's probabilities do not steer the choice (they did before: `loraserve-row`):
    in the simulated cluster (bench/bench_cluster_placement.py) the draw from the row
    sustained 0.93x the load of rank-aware routing, this order 1.24x, and a fixed split of the
    servers by rank told the true demand 0.92x: separating ranks by placement loses to
    routing each request by cost within the operating points.
    """

    name = "loraserve"

    def __init__(self, *args: Any, placement: PlacementConfig | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.rng = random.Random(self.seed)
        self.placer = Placer(self.perf, self.slo_ms, placement or PlacementConfig())

    def tick(
        self,
        now_s: float,
        servers: Sequence[ServerState],
        adapters: Mapping[str, int] | None = None,
    ) -> None:
        self.placer.maybe_step(now_s, servers, adapters)

    def holdings(self) -> tuple[int, Mapping[str, frozenset[str]]] | None:
        if self.placer.version == 0:
            return None
        per_server: dict[str, set[str]] = {}
        for adapter, shares in self.placer.assignment.items():
            for server in shares:
                per_server.setdefault(server, set()).add(adapter)
        return self.placer.version, {s: frozenset(a) for s, a in per_server.items()}

    def order(self, request: RouteRequest, servers: Sequence[ServerState]) -> list[int]:
        self.placer.record(request)
        usable = self._usable(request, servers)
        keys = {i: self._key(request, servers[i]) for i in usable}
        return sorted(usable, key=lambda i: (self._over(request, servers[i], keys[i]), keys[i], i))

    def _usable(self, request: RouteRequest, servers: Sequence[ServerState]) -> list[int]:
        """Servers that hold the adapter, else (none up) the servers of its row."""
        usable = [i for i, s in enumerate(servers) if s.serves(request)]
        row = self.placer.row(request.adapter) if request.adapter is not None else None
        if not usable and row is not None:  # no holder is up: the row's servers fetch it
            usable = [
                i for i, s in enumerate(servers) if s.url in row[0] and _same_model(request, s)
            ]
        return usable

    def _over(self, request: RouteRequest, server: ServerState, key: tuple) -> bool:
        """Whether `server` would be past its operating point with `request` (class docstring);
        `key` is its rank-aware key (+inf: past the decode SLO)."""
        if math.isinf(key[0]):
            return True
        limit = self.placer.batch_limit(max(server.batch.max_rank, request.rank))
        return limit is not None and server.batch.num + 1 > limit

    def choose(self, request: RouteRequest, servers: Sequence[ServerState]) -> int | None:
        ranked = self.order(request, servers)
        return ranked[0] if ranked else None


class LoRAServeRow(LoRAServe):
    """Ablation of `loraserve` (its routing until the cluster benchmark ruled against it): the
    row's probabilities steer the choice.

    Two servers are drawn from the adapter's row by its probabilities (one when the row has
    one) and the one with the lower rank-aware cost goes first, then the rest of the row, then
    every other server that holds the adapter, all by cost, except that among those others the
    servers placed with at least the request's rank (or with nothing) go before those it would
    pad to a higher rank (the paper's step 4, "a server with higher maximum rank", applied to a
    spill). If the first is past its operating point, the first server of that order that is
    not goes first: a request leaves its row only when its row is full. Requests without an
    adapter, and adapters not placed yet, are routed by the rank-aware cost.
    """

    name = "loraserve-row"
    num_choices = 2

    def order(self, request: RouteRequest, servers: Sequence[ServerState]) -> list[int]:
        self.placer.record(request)
        row = self.placer.row(request.adapter) if request.adapter is not None else None
        usable = self._usable(request, servers)
        keys = {i: self._key(request, servers[i]) for i in usable}
        if row is None:
            return sorted(usable, key=lambda i: (keys[i], i))
        index = {servers[i].url: i for i in usable}
        in_row = [index[url] for url in row[0] if url in index]
        drawn: list[int] = []
        for _ in range(min(self.num_choices, len(in_row)) * 4):  # a few tries for distinct ones
            url = self.placer.draw(request.adapter, self.rng)
            if url in index and index[url] not in drawn:
                drawn.append(index[url])
            if len(drawn) == min(self.num_choices, len(in_row)):
                break
        first = self._first_choices(request, index, drawn)
        taken = set(first)
        rest = [i for i in in_row if i not in taken]
        taken.update(rest)
        others = [i for i in usable if i not in taken]
        pads = {i: 0 < self.placer.max_rank(servers[i].url) < request.rank for i in others}
        ranked = [
            *sorted(first, key=lambda i: (keys[i], i)),
            *sorted(rest, key=lambda i: (keys[i], i)),
            *sorted(others, key=lambda i: (pads[i], keys[i], i)),
        ]
        if ranked and self._over(request, servers[ranked[0]], keys[ranked[0]]):
            # stable: keeps the preference among the servers within their operating point
            ranked.sort(key=lambda i: self._over(request, servers[i], keys[i]))
        return ranked

    def _first_choices(
        self, request: RouteRequest, index: Mapping[str, int], drawn: list[int]
    ) -> list[int]:
        """The servers the cost picks among first (index: url -> position of usable servers)."""
        return drawn


class LoRAServeGroup(LoRAServeRow):
    """Ablation of `loraserve-row`: the cost decides among the drawn servers and every server the
    placement gave to the request's rank (its group, scheduler/loraserve.py `Placer.group`),
    not only the adapter's row: more servers to absorb bursts, more adapters fetched."""

    name = "loraserve-group"

    def _first_choices(
        self, request: RouteRequest, index: Mapping[str, int], drawn: list[int]
    ) -> list[int]:
        group = [index[url] for url in self.placer.group(request.rank) if url in index]
        return sorted(set(drawn) | set(group))


def _same_model(request: RouteRequest, server: ServerState) -> bool:
    """Healthy and of the request's base model: a server that can fetch any of its adapters."""
    if not server.healthy:
        return False
    named = request.base_model and server.base_model
    return not (named and request.base_model != server.base_model)


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        RankAware,
        PrefixAware,
        RandomPolicy,
        FirstFit,
        LeastLoaded,
        LoRAServe,
        LoRAServeRow,
        LoRAServeGroup,
    )
}


def make_policy(
    name: str,
    perf: PerfModels,
    slo_ms: float,
    avg_resp_len: float = DEFAULT_AVG_RESP_LEN,
    seed: int = 0,
    **options: Any,
) -> Policy:
    """The policy registered under `name` (see POLICIES); `options` go to its class (loraserve:
    `placement=PlacementConfig(...)`; prefix-aware: `prefix=`, `weights=PrefixWeights(...)`)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
    return cls(perf, slo_ms, avg_resp_len, seed, **options)
