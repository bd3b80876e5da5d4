"""LoRAServe's control loop: observe demand, re-place every `interval_s`, keep the routing table.

The `Placer` is what the `loraserve` policy (scheduler/policies/) routes with and what the
scheduler's placement loop (scheduler/placement_loop.py) and the simulator drive through
`maybe_step(now_s, servers, adapters)`:
- the first call starts the clock; until the first step there is no table, and requests go by
  the rank-aware cost among the servers that hold their adapter (what they were started with);
- a step runs every `interval_s`, from the demand observed since the last one, and places every
  known adapter (those without demand too);
- a server of the table that is no longer live (unhealthy or gone) triggers a step at once,
  with the last demand estimates: its adapters get new homes before the interval ends;
- a new server is simply live at the next step, and the packing gives it a share.

The operating points are recomputed each step from the perf models, the SLO and the mean prompt
and output lengths observed so far (scheduler/operating_points.py), unless the config carries
profiled ones (`points`, as LoRAServe profiles each rank on the hardware beforehand; the cluster
benchmark profiles them on a simulated server).
"""

from __future__ import annotations

import bisect
import logging
import random
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from toppings.scheduler.demand import DemandTracker
from toppings.scheduler.operating_points import (
    OperatingPointConfig,
    batch_at,
    operating_points,
)
from toppings.scheduler.perf_model import PerfModels
from toppings.scheduler.placement import PlacementResult, Route, place
from toppings.scheduler.state import RouteRequest, ServerState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlacementConfig:
    interval_s: float = 10.0  # LoRAServe's time step
    smoothing: float = 0.5  # weight of the last step in the demand level (demand.py)
    trend: float = 0.5  # weight of the last change in the demand trend (0: no extrapolation)
    headroom: float = 0.9  # see operating_points.py
    max_batch_size: int = 128  # per server, as the engine's default
    max_total_tokens: int = 40_000  # KV slots per server (the simulator's default)
    points: tuple[tuple[int, float], ...] = ()  # profiled (rank, tokens/s); () derives them

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError("the placement interval must be positive")
        if any(rank <= 0 or tps <= 0 for rank, tps in self.points):
            raise ValueError("profiled operating points need positive ranks and tokens/s")


class Placer:
    """Demand tracker, placement steps and the routing table they produce."""

    def __init__(self, perf: PerfModels, slo_ms: float, config: PlacementConfig):
        self.perf = perf
        self.slo_ms = slo_ms
        self.config = config
        self.tracker = DemandTracker(config.smoothing, config.trend)
        self._lock = threading.Lock()  # one step at a time
        # adapter -> (servers, cumulative probabilities); replaced whole, read without a lock
        self._draw: dict[str, tuple[tuple[str, ...], tuple[float, ...]]] = {}
        self.assignment: dict[str, dict[str, float]] = {}
        self.demand: dict[str, float] = {}
        self.last_step_s: float | None = None
        self.version = 0
        self.history: list[dict] = []
        self._levels: dict[int, tuple[str, ...]] = {}
        self._max_rank: dict[str, int] = {}  # server -> max rank of what it was placed
        self._batch_limits: dict[int, int] = {}  # rank -> batch size at its operating point

    def record(self, request: RouteRequest) -> None:
        if request.adapter is not None:
            self.tracker.record(
                request.adapter, request.rank, request.prompt_tokens, request.max_new_tokens
            )

    def row(self, adapter: str) -> tuple[tuple[str, ...], tuple[float, ...]] | None:
        """The adapter's servers and cumulative probabilities, or None when not placed."""
        return self._draw.get(adapter)

    def group(self, rank: int) -> tuple[str, ...]:
        """Servers whose placed max rank is the smallest level >= `rank` (rank's own group)."""
        levels = self._levels
        for level, urls in levels.items():
            if level >= rank:
                return urls
        return ()

    def max_rank(self, server: str) -> int:
        """The highest rank the last step placed on `server` (0: nothing placed, or no step)."""
        return self._max_rank.get(server, 0)

    def draw(self, adapter: str, rng: random.Random) -> str | None:
        row = self._draw.get(adapter)
        if row is None:
            return None
        servers, cumulative = row
        idx = bisect.bisect_right(cumulative, rng.random() * cumulative[-1])
        return servers[min(idx, len(servers) - 1)]

    def routes(self) -> list[Route]:
        return [
            Route(adapter, server, p)
            for adapter, shares in sorted(self.assignment.items())
            for server, p in sorted(shares.items())
        ]

    def maybe_step(
        self,
        now_s: float,
        servers: Sequence[ServerState],
        adapters: Mapping[str, int] | None = None,
    ) -> PlacementResult | None:
        """Run a placement step when one is due (see the module docstring); None otherwise.

        adapters: every adapter the cluster knows (name -> rank), placed even without demand.
        """
        live = [s.url for s in servers if s.healthy]
        if not live:
            return None
        with self._lock:
            placed = {s for shares in self.assignment.values() for s in shares}
            if self.last_step_s is None:  # start the clock: no demand seen yet
                self.last_step_s = now_s
                return None
            if now_s - self.last_step_s >= self.config.interval_s:
                reason = "interval"
            elif placed - set(live):
                reason = "membership"
            else:
                return None
            if reason == "interval":
                self.demand = self.tracker.roll(now_s - self.last_step_s)
                self.last_step_s = now_s
            ranks = dict(adapters or {})
            ranks.update(self.tracker.ranks())
            kernel = next(s.kernel for s in servers if s.healthy)
            shape = self._shape(kernel)
            points = self._points(shape, ranks)
            self._batch_limits = {r: batch_at(self.perf, shape, r, p) for r, p in points.items()}
            result = place(self.demand, ranks, live, points, self.assignment)
            self._publish(result, now_s, reason)
            return result

    def _shape(self, kernel: str) -> OperatingPointConfig:
        """Server limits and the mean request observed so far, for the operating-point model."""
        lengths = self.tracker.mean_lengths()
        shape = {}
        if lengths is not None:
            shape = {"mean_prompt_tokens": max(1.0, lengths[0]),
                     "mean_output_tokens": max(1.0, lengths[1])}  # fmt: skip
        return OperatingPointConfig(
            self.slo_ms,
            kernel,
            headroom=self.config.headroom,
            max_batch_size=self.config.max_batch_size,
            max_total_tokens=self.config.max_total_tokens,
            **shape,
        )

    def _points(self, shape: OperatingPointConfig, ranks: Mapping[str, int]) -> dict[int, float]:
        if self.config.points:
            profiled = dict(self.config.points)
            missing = set(ranks.values()) - set(profiled)
            if not missing:
                return profiled
            log.warning("no profiled operating point for ranks %s: deriving all", sorted(missing))
        return operating_points(self.perf, shape, set(ranks.values()))

    def batch_limit(self, rank: int) -> int | None:
        """Requests a server whose batch pads to `rank` holds at its operating point (the
        smallest placed rank >= `rank` when `rank` itself has none); None before any step."""
        limits = self._batch_limits
        if rank in limits:
            return limits[rank]
        above = [r for r in limits if r >= rank]
        if above:
            return limits[min(above)]
        return limits[max(limits)] if limits else None

    def _publish(self, result: PlacementResult, now_s: float, reason: str) -> None:
        draw = {}
        for adapter, shares in result.assignment.items():
            servers = tuple(sorted(shares))
            cumulative, total = [], 0.0
            for server in servers:
                total += shares[server]
                cumulative.append(total)
            draw[adapter] = (servers, tuple(cumulative))
        self._draw = draw
        self.assignment = result.assignment
        levels: dict[int, list[str]] = {}
        for server, level in result.server_max_rank.items():
            levels.setdefault(level, []).append(server)
        self._levels = {level: tuple(sorted(urls)) for level, urls in sorted(levels.items())}
        self._max_rank = dict(result.server_max_rank)
        self.version += 1
        per_server = result.adapters_per_server()
        self.history.append({
            "time_s": now_s,
            "reason": reason,
            "moves": result.moves,
            "num_servers": len(per_server),
            "num_demanded": len(self.demand),
            "target_util": result.target_util,
            "budgets": {str(r): b for r, b in sorted(result.budgets.items())},
            "adapters_per_server_mean": sum(per_server.values()) / max(1, len(per_server)),
            "adapters_per_server_max": max(per_server.values(), default=0),
        })  # fmt: skip
        log.info(
            "placement step %d (%s): %d moves, %d servers, target util %.2f",
            *(self.version, reason, result.moves, len(per_server), result.target_util),
        )
