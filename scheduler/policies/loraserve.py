"""LoRAServe's routing on Toppings' cost, with its placement (scheduler/loraserve.py) deciding
which servers hold which adapters, and its two ablations (`loraserve-row`, `loraserve-group`)."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

from toppings.scheduler.loraserve import PlacementConfig, Placer
from toppings.scheduler.policies.rank_aware import RankAware
from toppings.scheduler.state import RouteRequest, ServerState


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
    in the simulated cluster (bench/bench_cluster_placement.py, its results in
    bench/results/cluster_placement.json) the draw from the row and a fixed split of the
    servers by rank both sustained less load than rank-aware routing, and this order more:
    separating ranks by placement loses to routing each request by cost within the operating
    points.
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
