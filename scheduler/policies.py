"""Routing policies: pick a server for a request from the servers' states.

Every policy answers `order(request, servers)`: the indices of the servers that can take the
request (healthy, same base model, hosting the adapter), best first, so a caller can fall back
to the next one when a server fails. `choose` is the first of that order. Policies are picked by
name from POLICIES; the scheduler and the simulator run the same objects.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

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

    Empty server: the product is 0, and we keep it. The product charges the request's delay to
    every request already there; on an empty server nobody is delayed, so 0 is the right price
    and an idle server wins. Ties (several empty servers, or every server over the SLO) are broken
    by the unweighted cost, then by the predicted decode latency with the request (the least SLO
    violation when all are +inf), then by server order. inf * 0 would be nan, so an over-SLO
    server gets total = +inf directly.
    """

    name = "rank-aware"

    def _key(self, request: RouteRequest, server: ServerState) -> tuple[float, float, float]:
        decode = self.perf.decode(server.kernel)
        batch_after = server.batch.add(request.rank, request.prompt_tokens)
        decode_after = decode.predict(batch_after)
        if decode_after > self.slo_ms:
            return math.inf, math.inf, decode_after
        prefill = self.perf.prefill(server.kernel)
        queue_after = server.queue.add(request.rank, request.prompt_tokens)
        d_prefill = prefill.predict(queue_after) - prefill.predict(server.queue)
        d_decode = decode_after - decode.predict(server.batch)
        cost = d_prefill / self.avg_resp_len + d_decode
        return cost * server.num_requests, cost, decode_after


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


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (RankAware, RandomPolicy, FirstFit, LeastLoaded)
}


def make_policy(
    name: str,
    perf: PerfModels,
    slo_ms: float,
    avg_resp_len: float = DEFAULT_AVG_RESP_LEN,
    seed: int = 0,
) -> Policy:
    """The policy registered under `name` (see POLICIES)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
    return cls(perf, slo_ms, avg_resp_len, seed)
