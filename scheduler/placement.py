"""LoRAServe's adapter placement (its Algorithm 1): which servers serve which adapters, and with
what share of each adapter's traffic.

Units: an adapter's demand is tokens/s (prompt + output) and a rank's operating point is the
tokens/s one server sustains under the SLO with that rank alone (scheduler/operating_points.py),
so demand / operating point is the fraction of a server the adapter needs ("util").

One step, for S servers:
1. util per adapter; util per rank; target = total util / S, what each server should carry.
2. Budget per rank = round(rank util / target) servers; when the rounding asks for more than S
   servers, the ranks rounded up the most give one back until the budgets fit.
3. Fractional bin packing, rank by rank: a rank's adapters, busiest first, fill its budget of
   servers up to `target` each; an adapter that does not fit is split across the next server
   (its traffic shares are the split), so only a rank's busiest adapters span several servers.
4. Leftovers (ranks without budget, what did not fit), highest rank first, go to the server with
   the highest max rank that still has room, the least loaded of those (a server that already
   pads to a high rank absorbs a lower rank without slowing its own requests); when no server
   has room, to the least loaded one.
5. Relabelling: steps 2-4 fill anonymous bins; each bin is given the live server that already
   holds most of the bin's adapters (greedy maximum-weight matching), so that a step moves as
   few adapters as it can.
6. Adapters without demand are not packed, but they still get requests now and then (the long
   tail): each stays on a live server that held it if that server's max rank is at least the
   adapter's, or the server carries no demand (it pads no one there), else it goes to the
   server with the fewest adapters among those whose max rank is the adapter's rank, or
   failing that the smallest max rank above it, or failing that the highest max rank below it;
   no server takes more than IDLE_SLACK x the mean number of adapters per server this way.
   Every adapter is always on some server.

The result maps each adapter to {server: probability}, probabilities summing to 1; routing draws
from it (scheduler/policies/loraserve.py).
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

EPS = 1e-12
MIN_SPLIT = 0.01  # a share below 1% of an adapter's util is not worth a copy of it
IDLE_SLACK = 1.25  # adapters per server, over the mean, that step 6 tolerates

Assignment = dict[str, dict[str, float]]  # adapter -> server -> probability (sums to 1)


@dataclass(frozen=True, slots=True)
class Route:
    """One row of the routing table: requests for `adapter` go to `server` with `probability`."""

    adapter: str
    server: str
    probability: float


@dataclass
class PlacementResult:
    assignment: Assignment
    moves: int  # (adapter, server) pairs that the previous assignment did not have
    target_util: float
    budgets: dict[int, int]
    server_util: dict[str, float]  # per server: sum of its adapters' util shares
    server_max_rank: dict[str, int]

    def routes(self) -> list[Route]:
        return [
            Route(adapter, server, p)
            for adapter, shares in sorted(self.assignment.items())
            for server, p in sorted(shares.items())
        ]

    def adapters_per_server(self) -> dict[str, int]:
        counts = dict.fromkeys(self.server_util, 0)
        for shares in self.assignment.values():
            for server in shares:
                counts[server] += 1
        return counts


def count_moves(new: Mapping[str, Mapping[str, float]], old: Mapping[str, Mapping[str, float]]):
    """(adapter, server) pairs in `new` that `old` lacks: adapters some server must fetch."""
    return sum(len(set(servers) - set(old.get(a, ()))) for a, servers in new.items())


def place(
    demand: Mapping[str, float],
    ranks: Mapping[str, int],
    servers: Sequence[str],
    points: Mapping[int, float],
    previous: Mapping[str, Mapping[str, float]] | None = None,
) -> PlacementResult:
    """One placement step over every adapter of `ranks` (name -> rank) on the live `servers`.

    demand: tokens/s per adapter (missing or 0: no demand); points: tokens/s per rank;
    previous: the last step's assignment (servers no longer live are ignored).
    """
    if not servers:
        raise ValueError("placement needs at least one live server")
    previous = previous or {}
    live = set(servers)
    util = {a: d / points[ranks[a]] for a, d in demand.items() if d > 0 and a in ranks}
    rank_util: dict[int, float] = defaultdict(float)
    for a, u in util.items():
        rank_util[ranks[a]] += u
    total = sum(rank_util.values())
    target = total / len(servers)
    budgets = _budgets(rank_util, target, len(servers)) if total > 0 else {}
    bins, loads, bin_rank = _pack(util, ranks, budgets, target, len(servers))
    _place_leftovers(bins, loads, bin_rank, util, ranks, target)
    label = _relabel(bins, bin_rank, util, ranks, servers, previous, live)
    assignment: Assignment = {}
    server_util = dict.fromkeys(servers, 0.0)
    server_max_rank = dict.fromkeys(servers, 0)
    for b, contents in enumerate(bins):
        server = label[b]
        server_util[server] = loads[b]
        server_max_rank[server] = bin_rank[b]
        for a, u in contents.items():
            assignment.setdefault(a, {})[server] = u / util[a]
    _place_idle(assignment, ranks, servers, previous, live, server_max_rank)
    moves = count_moves(assignment, previous)
    return PlacementResult(assignment, moves, target, budgets, server_util, server_max_rank)


def _budgets(rank_util: Mapping[int, float], target: float, num_servers: int) -> dict[int, int]:
    exact = {r: u / target for r, u in rank_util.items()}
    budgets = {r: round(x) for r, x in exact.items()}
    while sum(budgets.values()) > num_servers:
        r = max((r for r in budgets if budgets[r] > 0), key=lambda r: (budgets[r] - exact[r], r))
        budgets[r] -= 1
    return budgets


def _pack(util, ranks, budgets, target, num_bins):
    """Step 3: per rank (ascending), next-fit fractional packing of its busiest-first adapters
    into its budget of bins. Returns bins (adapter -> util), loads, and each bin's max rank;
    what did not fit stays in `util` minus what was packed (see _place_leftovers)."""
    bins: list[dict[str, float]] = [{} for _ in range(num_bins)]
    loads = [0.0] * num_bins
    bin_rank = [0] * num_bins
    by_rank: dict[int, list[str]] = defaultdict(list)
    for a in util:
        by_rank[ranks[a]].append(a)
    first = 0
    for rank in sorted(budgets):
        own = range(first, first + budgets[rank])
        first += budgets[rank]
        k = 0
        for a in sorted(by_rank[rank], key=lambda a: (-util[a], a)):
            left = util[a]
            while left > EPS and k < len(own):
                b = own[k]
                room = target - loads[b]
                if room < min(left, MIN_SPLIT * util[a]):  # full, or only a sliver left
                    k += 1
                    continue
                put = min(left, room)
                bins[b][a] = bins[b].get(a, 0.0) + put
                loads[b] += put
                bin_rank[b] = rank
                left -= put
    return bins, loads, bin_rank


def _place_leftovers(bins, loads, bin_rank, util, ranks, target) -> None:
    """Step 4: what _pack left, highest rank first, to the highest-max-rank bin with room."""
    packed: dict[str, float] = defaultdict(float)
    for contents in bins:
        for a, u in contents.items():
            packed[a] += u
    leftovers = [(a, util[a] - packed[a]) for a in util if util[a] - packed[a] > EPS * util[a]]
    leftovers.sort(key=lambda item: (-ranks[item[0]], -item[1], item[0]))
    for a, left in leftovers:
        rank = ranks[a]
        while left > EPS * util[a]:
            sliver = min(left, MIN_SPLIT * util[a])
            open_bins = [b for b in range(len(bins)) if target - loads[b] >= sliver]
            if open_bins:
                b = min(open_bins, key=lambda b: (-bin_rank[b], loads[b], b))
                put = min(left, target - loads[b])
            else:
                b = min(range(len(bins)), key=lambda b: (loads[b], b))
                put = left
            bins[b][a] = bins[b].get(a, 0.0) + put
            loads[b] += put
            bin_rank[b] = max(bin_rank[b], rank)
            left -= put


def _relabel(bins, bin_rank, util, ranks, servers, previous, live) -> list[str]:
    """Step 5: bin -> server, greedily matching the pairs that keep the most adapters in place:
    the bin's adapters the server held, plus the server's adapters without demand that step 6
    lets stay (rank up to the bin's max rank, any rank when the bin carries no demand)."""
    overlap: dict[tuple[int, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for b, contents in enumerate(bins):
        for a, u in contents.items():
            for server in previous.get(a, ()):
                if server in live:
                    weight = overlap[(b, server)]
                    weight[0] += 1  # adapters kept in place
                    weight[1] += u  # traffic kept in place (tie-break)
    idle: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for a, shares in previous.items():
        if a not in util and a in ranks:
            for server in shares:
                if server in live:
                    idle[server][ranks[a]] += 1
    for b in range(len(bins)):
        for server, by_rank in idle.items():
            top = bin_rank[b]
            kept = sum(n for r, n in by_rank.items() if top == 0 or r <= top)
            if kept:
                overlap[(b, server)][0] += kept
    order = sorted(overlap.items(), key=lambda item: (-item[1][0], -item[1][1], item[0]))
    label: dict[int, str] = {}
    taken: set[str] = set()
    for (b, server), _ in order:
        if b not in label and server not in taken:
            label[b] = server
            taken.add(server)
    free = iter(s for s in servers if s not in taken)
    return [label[b] if b in label else next(free) for b in range(len(bins))]


def _place_idle(assignment, ranks, servers, previous, live, max_rank) -> None:
    """Step 6: adapters without demand stay where they pad no one, else join their rank; no
    server holds more than IDLE_SLACK x the mean number of adapters per server (the tail's
    requests, which no estimate sees, spread like the adapters, and so does host memory)."""
    counts = dict.fromkeys(servers, 0)
    for shares in assignment.values():
        for server in shares:
            counts[server] += 1
    cap = math.ceil(IDLE_SLACK * len(ranks) / len(servers))
    homeless: dict[int, list[str]] = defaultdict(list)
    for a in sorted(ranks):
        if a in assignment:
            continue
        rank = ranks[a]
        held = [
            (p, s)
            for s, p in previous.get(a, {}).items()
            if s in live and (max_rank[s] >= rank or max_rank[s] == 0) and counts[s] < cap
        ]
        if held:
            server = max(held)[1]
            assignment[a] = {server: 1.0}
            counts[server] += 1
        else:
            homeless[rank].append(a)
    levels = sorted(set(max_rank.values()))
    heaps = {level: [] for level in levels}
    for i, s in enumerate(servers):
        heaps[max_rank[s]].append((counts[s], i, s))
    for heap in heaps.values():
        heapq.heapify(heap)
    for rank, names in homeless.items():
        # the rank's own level, then the levels above (no padding), then those below
        order = [r for r in levels if r >= rank] + [r for r in reversed(levels) if r < rank]
        for a in names:
            level = next((r for r in order if heaps[r][0][0] < cap), None)
            if level is None:  # every server at the cap: the fewest adapters anywhere
                level = min(order, key=lambda r: heaps[r][0])
            count, i, server = heapq.heappop(heaps[level])
            assignment[a] = {server: 1.0}
            heapq.heappush(heaps[level], (count + 1, i, server))
