"""The baselines: random, Punica's first-fit consolidation, dLoRA's least-loaded balancing."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from toppings.scheduler.policies.base import KeyedPolicy, Policy, candidates
from toppings.scheduler.state import RouteRequest, ServerState


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
