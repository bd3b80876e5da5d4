"""The interface every routing policy implements (`Policy`), and `KeyedPolicy`, the policies that
rank servers by a sort key.

Every policy answers `order(request, servers)`: the indices of the servers that can take the
request (healthy, same base model, hosting the adapter), best first, so a caller can fall back
to the next one when a server fails. `choose` is the first of that order. `tick(now_s, servers,
adapters)` is called periodically by the scheduler and the simulator (the placement of
`loraserve` runs there).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

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
