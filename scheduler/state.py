"""What a routing policy sees: a request to place and a small summary of each server.

A `ServerState` is built from one server's `GET /stats` JSON (or from a simulated server) plus
the requests the scheduler routed there since that snapshot, which the snapshot cannot show yet.
Those are counted as queued: they still need their prefill and will join the next decode batch.

The `/stats` body is parsed with `toppings.server.requests.stats_schema.ServerStats` (its
docstring holds the schema): like the error vocabulary, it is part of the HTTP contract, and the
only other module of the server package the scheduler imports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from toppings.scheduler.kv_index.prefix_key import PrefixKey
from toppings.server.requests.stats_schema import RequestView, Residency, ServerStats


class BatchShape(NamedTuple):
    """Aggregates of a set of requests: all the perf models need, O(1) to extend.

    A request without an adapter has rank 0. `sum_token_rank` is sum(tokens_i * rank_i), the
    LoRA work of a prefill without padding; `sum_tokens` counts prompt tokens.
    """

    num: int = 0
    sum_rank: int = 0
    max_rank: int = 0
    sum_tokens: int = 0
    sum_token_rank: int = 0

    def add(self, rank: int, tokens: int) -> BatchShape:
        """This set plus one request of `rank` with `tokens` prompt tokens."""
        return BatchShape(
            self.num + 1,
            self.sum_rank + rank,
            rank if rank > self.max_rank else self.max_rank,
            self.sum_tokens + tokens,
            self.sum_token_rank + tokens * rank,
        )

    def merge(self, other: BatchShape) -> BatchShape:
        return BatchShape(
            self.num + other.num,
            self.sum_rank + other.sum_rank,
            max(self.max_rank, other.max_rank),
            self.sum_tokens + other.sum_tokens,
            self.sum_token_rank + other.sum_token_rank,
        )

    @classmethod
    def of(cls, ranks: Iterable[int], tokens: Iterable[int]) -> BatchShape:
        """Shape of requests given as parallel lists of ranks and prompt tokens."""
        shape = cls()
        for rank, num_tokens in zip(ranks, tokens, strict=True):
            shape = shape.add(rank, num_tokens)
        return shape


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """A request to place. rank 0 and adapter None mean the base model alone. prefix: the
    blocks a server may hold of its prompt (None: its token ids are not known, scheduler.router)."""

    adapter: str | None
    rank: int
    prompt_tokens: int
    max_new_tokens: int
    base_model: str = ""
    prefix: PrefixKey | None = None
    resolve: bool = False  # no server hosts the adapter: one with a resolver may find it


@dataclass(frozen=True, slots=True)
class ServerState:
    """One server as a policy sees it.

    batch: running + queued + routed-since-snapshot, i.e. the decode batch once all are admitted.
    queue: queued + routed-since-snapshot, the requests whose prefill is still pending.
    room_tokens: KV slots left after the queue's reservations (prompt + max_new_tokens each).
    adapters: the adapters the server holds (in host memory at least); device_adapters and
    loading_adapters: those of them with every layer on its device, and those on their way.
    """

    url: str
    kernel: str
    healthy: bool
    num_running: int
    num_queued: int
    batch: BatchShape
    queue: BatchShape
    room_tokens: int
    adapters: frozenset[str] = frozenset()
    base_model: str = ""
    num_routed: int = 0
    device_adapters: frozenset[str] = frozenset()
    loading_adapters: frozenset[str] = frozenset()
    resolves: bool = False  # loads an adapter name on first use (its --lora-resolver)

    def residency(self, adapter: str | None) -> int:
        """How far the adapter is from the device, for routing: 0 on the device (or the base
        model), 1 loading there, 2 in host memory only, 3 not held (it must be fetched)."""
        if adapter is None or adapter in self.device_adapters:
            return 0
        if adapter in self.loading_adapters:
            return 1
        return 2 if adapter in self.adapters else 3

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_queued

    def serves(self, request: RouteRequest) -> bool:
        """Healthy, same base model (when both are named), and hosts the adapter (or, for an
        adapter no server hosts, loads adapters on first use)."""
        if not self.healthy:
            return False
        if request.base_model and self.base_model and request.base_model != self.base_model:
            return False
        return (request.adapter is None or request.adapter in self.adapters
                or (request.resolve and self.resolves))  # fmt: skip

    def with_routed(self, rank: int, prompt_tokens: int, max_new_tokens: int) -> ServerState:
        """This state after the scheduler routed one more request here (counted as queued)."""
        return replace(
            self,
            num_queued=self.num_queued + 1,
            batch=self.batch.add(rank, prompt_tokens),
            queue=self.queue.add(rank, prompt_tokens),
            room_tokens=self.room_tokens - prompt_tokens - max_new_tokens,
            num_routed=self.num_routed + 1,
        )

    @classmethod
    def from_stats(
        cls, url: str, body: Mapping[str, Any], listed: frozenset[str] | None = None
    ) -> ServerState:
        """Parse a `/stats` JSON body; raises KeyError/TypeError/ValueError when malformed.
        `listed`: the adapter names of the caller's earlier /stats, for a body that left its
        list out as unchanged (`adapters_since`)."""
        stats = ServerStats.from_json(dict(body))
        names = frozenset(str(a.name) for a in stats.adapters)
        if stats.adapters_unchanged:
            if listed is None:
                raise ValueError("/stats left its adapters out, and none are known")
            names = listed
        running = _shape(stats.running, with_output=True)
        queue = _shape(stats.queue, with_output=False)
        reserved = sum(int(r.prompt_tokens) + int(r.max_new_tokens) for r in stats.queue)
        return cls(
            url=url,
            kernel=stats.kernel,
            healthy=bool(stats.healthy),
            num_running=len(stats.running),
            num_queued=len(stats.queue),
            batch=running.merge(queue),
            queue=queue,
            room_tokens=int(stats.free_kv_tokens) - reserved,
            adapters=names,
            base_model=str(stats.model),
            device_adapters=frozenset(
                {a.name for a in stats.adapters if a.state is Residency.DEVICE or a.resident}
                | set(stats.resident_adapters)  # all there is where the list was left out
            ),
            loading_adapters=frozenset(
                {a.name for a in stats.adapters if a.state is Residency.LOADING}
                | set(stats.loading_adapters)
            )
            - {a.name for a in stats.adapters if a.resident},
            resolves=bool(stats.lora_resolver),
        )


def _shape(requests: Iterable[RequestView], with_output: bool) -> BatchShape:
    """Aggregate /stats request entries. Running requests count generated tokens as context."""
    shape = BatchShape()
    for req in requests:
        tokens = int(req.prompt_tokens) + (int(req.output_tokens) if with_output else 0)
        shape = shape.add(int(req.rank or 0), tokens)
    return shape


def hosted_anywhere(
    states: Iterable[ServerState], adapter: str | None, base_model: str, resolve: bool = False
) -> bool:
    """Whether a registered server, up or not, serves the model: runs the base model, hosts the
    adapter, or (`resolve`: an adapter no server hosts) loads adapters on first use. A model
    none serves is a 404 (an adapter of the registry no server holds any more, or recorded for
    a base no server runs), not a 503 that never clears."""
    states = list(states)
    if adapter is None:
        return any(s.base_model == base_model for s in states)
    return any(adapter in s.adapters or (resolve and s.resolves) for s in states)
