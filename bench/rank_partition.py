"""A reference point for bench_cluster_placement: the cluster split by rank with perfect knowledge.

`rank-partition` is not a policy a scheduler could run: it is told the trace's true share of
requests per rank before the first request arrives. It gives each rank a fixed group of servers
in proportion to the work that rank brings (share / per-server capacity, the operating point
profiled for the rank) and routes each request by Toppings' rank-aware cost inside its rank's
group, so no server ever pads a request to a higher rank; only when every server of the group
is past the decode SLO does a request go to the cheapest server of another group. It answers:
how much can separating ranks gain at all over routing by the rank-aware cost alone, in this
simulator and with these perf models? A placement policy that separates ranks (LoRAServe) is
bounded by roughly the same figure, minus what demand estimates and adapter moves cost it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from toppings.scheduler.policies import RankAware
from toppings.scheduler.state import RouteRequest, ServerState

NAME = "rank-partition"


def rank_budgets(
    shares: Mapping[int, float], capacity: Mapping[int, float], num_servers: int
) -> dict[int, int]:
    """Servers per rank, proportional to share[rank] / capacity[rank] (largest remainders), at
    least one per rank with requests. shares: fraction of requests per rank; capacity: what one
    server sustains with that rank alone, in any unit common to all ranks."""
    work = {r: s / capacity[r] for r, s in shares.items() if s > 0}
    if len(work) > num_servers:
        raise ValueError("fewer servers than ranks: no partition gives each rank a server")
    total = sum(work.values())
    exact = {r: num_servers * w / total for r, w in work.items()}
    budgets = {r: max(1, math.floor(x)) for r, x in exact.items()}
    by_remainder = sorted(exact, key=lambda r: (budgets[r] - exact[r], r))
    while sum(budgets.values()) < num_servers:
        r = by_remainder.pop(0)
        budgets[r] += 1
    while sum(budgets.values()) > num_servers:
        r = max((r for r in budgets if budgets[r] > 1), key=lambda r: budgets[r] - exact[r])
        budgets[r] -= 1
    return budgets


class RankPartition(RankAware):
    """Fixed rank groups (see the module docstring); `budgets` maps rank -> number of servers,
    given to the servers in their order, lowest rank first."""

    name = NAME

    def __init__(self, *args, budgets: Mapping[int, int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.budgets = dict(sorted(budgets.items()))
        self._group: dict[str, int] = {}  # server url -> its rank

    def _assign(self, servers: Sequence[ServerState]) -> None:
        urls = [s.url for s in servers]
        if sum(self.budgets.values()) != len(urls):
            raise ValueError(f"budgets cover {sum(self.budgets.values())} of {len(urls)} servers")
        first = 0
        for rank, count in self.budgets.items():
            self._group.update((url, rank) for url in urls[first : first + count])
            first += count

    def order(self, request: RouteRequest, servers: Sequence[ServerState]) -> list[int]:
        if not self._group:
            self._assign(servers)
        own = min((r for r in self.budgets if r >= request.rank), default=max(self.budgets))
        keyed = sorted(
            (self._key(request, s), i) for i, s in enumerate(servers) if s.serves(request)
        )
        # inside the group, by cost, unless past the SLO; then everyone else by cost
        inside = [
            i
            for key, i in keyed
            if self._group.get(servers[i].url) == own and not math.isinf(key[0])
        ]
        taken = set(inside)
        return inside + [i for _, i in keyed if i not in taken]

    def choose(self, request: RouteRequest, servers: Sequence[ServerState]) -> int | None:
        ranked = self.order(request, servers)
        return ranked[0] if ranked else None
