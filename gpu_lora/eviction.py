"""What leaves the device first when room is needed: one table of policies over typed candidates.

A candidate is one cached item that may leave: a prefix-tree block of KV or an idle adapter
(`ItemKind`), with its bytes, visits and last use, and for an adapter its id (the key the
device cache and pool know it by), name and rank. A policy only orders candidates, least
valuable first; the owner of the memory decides who is a candidate and moves the bytes. One
owner holds the node's one `Eviction` (a policy of `EVICTION_POLICIES` and what it may know of
the node): the server's memory reclaimer, in both memory layouts. It orders idle adapters when
an adapter's load needs room in the adapter cache's own byte budget (`--memory-layout static`),
and KV leaves and idle adapters together when they share one pool (`--memory-layout pool`);
the adapter cache only offers its candidates. So the same adapters in the same state come out
in the same order whichever layout asks, and no two deciders call into each other.

`fastlibra` is FastLibra's cost model (see ../shared/papers/fastlibra.txt, section 5):
    Eval_i = LoRA_Eval_i * cost_i * prob_i * (1 - sigmoid(t_i))
cost_i the time to bring the item back over the link (proportional to its bytes), prob_i its
share of the visits of its kind, t_i the seconds since it was last used. LoRA_Eval =
max(1, Low_lora / Now_lora) for adapters, where Low_lora = sum_i (1 - (1 - p_i)^BS) is the
number of adapters a batch of the recent size BS is expected to need and Now_lora the number on
the device: while fewer adapters are cached than batches use, adapters weigh more. KV nodes take
LoRA_Eval = 1 (our choice: the paper's reward is about the number of adapters).

`chameleon` is Chameleon's (MICRO'25) score 0.45 F + 0.10 R + 0.45 S over frequency, recency
and size; `lru` the least recently used first (vLLM's, and FastLibra's baseline).

`Usage` and `least_recently_used` are the one recency bookkeeping of the node.
"""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

RECENT_BATCH_S = 5.0  # FastLibra's BS: the mean batch of the steps of the last seconds


@dataclass
class Usage:
    """When an item was last used and by how many requests."""

    last_used: float = 0.0  # monotonic seconds
    frequency: int = 0

    def touch(self, now: float) -> None:
        self.last_used = now
        self.frequency += 1


class HasLastUse(Protocol):
    @property
    def last_used(self) -> float: ...


T = TypeVar("T", bound=HasLastUse)
P = TypeVar("P")  # a policy class's instances


def least_recently_used(items: Iterable[T]) -> list[T]:
    """Items by last use, oldest first; equal times keep the order they came in (stable)."""
    return sorted(items, key=lambda c: c.last_used)


class ItemKind(enum.Enum):
    """What a cached item is."""

    KV = "kv"  # a prefix-tree block
    ADAPTER = "adapter"  # an idle adapter's weights


@dataclass
class Candidate:
    """One item that may leave the device."""

    kind: ItemKind
    item: object  # KV: the prefix-tree node; ADAPTER: the adapter's id (the cache's key)
    num_bytes: int
    visits: int  # requests that used it
    last_used: float  # monotonic seconds
    name: str = ""  # an adapter's name (ties are broken by it); "" for KV
    rank: int = 0  # an adapter's rank; 0 for KV

    @classmethod
    def adapter(
        cls, adapter_id: Hashable, name: str, num_bytes: int, usage: Usage, rank: int = 0
    ) -> Candidate:
        """An idle adapter as a candidate."""
        return cls(ItemKind.ADAPTER, adapter_id, num_bytes, usage.frequency, usage.last_used,
                   name, rank)  # fmt: skip


@dataclass
class EvictionContext:
    """What a policy may know of the node beyond its candidates."""

    now: float
    visits_by_kind: dict[ItemKind, int]  # total visits of each kind's items
    expected_adapters: float  # Low_lora: adapters a recent batch is expected to use
    cached_adapters: int  # Now_lora

    @classmethod
    def of(cls, candidates: list[Candidate], now: float | None = None) -> EvictionContext:
        """What the candidates alone tell: their visits, no batch, their adapters cached."""
        visits = {kind: sum(c.visits for c in candidates if c.kind is kind) for kind in ItemKind}
        cached = sum(1 for c in candidates if c.kind is ItemKind.ADAPTER)
        return cls(time.monotonic() if now is None else now, visits, 0.0, cached)


class EvictionPolicy:
    """Orders eviction candidates, first to go first (`ctx` None: `EvictionContext.of` them)."""

    name = "base"

    def order(
        self, candidates: list[Candidate], ctx: EvictionContext | None = None
    ) -> list[Candidate]:
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently used first, whatever its kind (ties: KV first, in the order given, then
    adapters by name)."""

    name = "lru"

    def order(
        self, candidates: list[Candidate], ctx: EvictionContext | None = None
    ) -> list[Candidate]:
        return least_recently_used(sorted(candidates, key=lambda c: c.name))


class ChameleonPolicy(EvictionPolicy):
    """Chameleon (MICRO'25): Score = 0.45 F + 0.10 R + 0.45 S, lowest score evicted first.

    F (visits), R (recency) and S (size) are each normalised to [0, 1] over the candidates; a
    large item scores high because bringing it back costs more.
    """

    name = "chameleon"
    weights = (0.45, 0.10, 0.45)

    def order(
        self, candidates: list[Candidate], ctx: EvictionContext | None = None
    ) -> list[Candidate]:
        if not candidates:
            return []
        freq = _normalise([c.visits for c in candidates])
        recency = _normalise([c.last_used for c in candidates])
        size = _normalise([c.num_bytes for c in candidates])
        wf, wr, ws = self.weights
        scores = [wf * f + wr * r + ws * s for f, r, s in zip(freq, recency, size)]
        ranked = sorted(range(len(candidates)), key=lambda i: (
            scores[i], candidates[i].last_used, candidates[i].name))  # fmt: skip
        return [candidates[i] for i in ranked]


class FastLibraPolicy(EvictionPolicy):
    """Lowest Eval first; see the module docstring."""

    name = "fastlibra"

    def value(self, c: Candidate, ctx: EvictionContext) -> float:
        prob = c.visits / max(1, ctx.visits_by_kind.get(c.kind, 0))
        age = max(0.0, ctx.now - c.last_used)
        decay = 1.0 / (1.0 + math.exp(min(age, 700.0)))  # 1 - sigmoid(t), without cancellation
        lora_eval = 1.0
        if c.kind is ItemKind.ADAPTER:
            lora_eval = max(1.0, ctx.expected_adapters / max(1, ctx.cached_adapters))
        return lora_eval * c.num_bytes * prob * decay

    def order(
        self, candidates: list[Candidate], ctx: EvictionContext | None = None
    ) -> list[Candidate]:
        ctx = ctx if ctx is not None else EvictionContext.of(candidates)
        return sorted(candidates, key=lambda c: (self.value(c, ctx), c.last_used))


def _normalise(values: list[float]) -> list[float]:
    """Min-max to [0, 1]; all equal -> all 0."""
    lo, hi = min(values), max(values)
    if hi == lo:
        return [0.0] * len(values)
    return [(v - lo) / (hi - lo) for v in values]


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    ChameleonPolicy.name: ChameleonPolicy,
    FastLibraPolicy.name: FastLibraPolicy,
}


def make_by_name(table: Mapping[str, Callable[[], P]], name: str, what: str) -> P:
    """A new instance of the class `table` holds under `name`; ValueError naming the choices."""
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; choose {sorted(table)}")
    return table[name]()


def make_policy(name: str) -> EvictionPolicy:
    return make_by_name(EVICTION_POLICIES, name, "eviction policy")


def expected_adapters(adapter_counts: Mapping[Hashable, int], batch_size: float) -> float:
    """FastLibra's Low_lora = sum_i (1 - (1 - p_i)^BS) from each adapter's request count."""
    total = sum(adapter_counts.values())
    if not total:
        return 0.0
    return sum(1.0 - (1.0 - n / total) ** batch_size for n in adapter_counts.values())


class Eviction:
    """One policy of the table and what it may know of the node: the recent batch sizes. A
    server has one, held by the one owner of eviction (its memory's reclaimer), so the order
    of the same candidates does not depend on the memory layout."""

    def __init__(self, policy: EvictionPolicy):
        self.policy = policy
        self._batch_sizes: deque[tuple[float, int]] = deque(maxlen=256)  # (when, requests)

    @classmethod
    def named(cls, name: str) -> Eviction:
        """The policy `name` of `EVICTION_POLICIES`; ValueError naming the choices."""
        return cls(make_policy(name))

    def observe_batch(self, now: float, batch_size: int) -> None:
        """A step ran `batch_size` requests (FastLibra's expected adapters use the recent size)."""
        self._batch_sizes.append((now, batch_size))

    def context(
        self,
        candidates: list[Candidate],
        now: float,
        adapter_visits: Mapping[Hashable, int],
        cached_adapters: int,
    ) -> EvictionContext:
        """The node as the policy sees it: KV visits over the KV candidates, adapter visits
        over every adapter used (`adapter_visits`, resident or not), the adapters a recent
        batch is expected to use and `cached_adapters` on the device."""
        kv_visits = sum(c.visits for c in candidates if c.kind is ItemKind.KV)
        visits = {ItemKind.KV: kv_visits, ItemKind.ADAPTER: sum(adapter_visits.values())}
        recent = [b for t, b in list(self._batch_sizes) if now - t <= RECENT_BATCH_S]
        batch = sum(recent) / len(recent) if recent else 1.0
        expected = expected_adapters(adapter_visits, batch)
        return EvictionContext(now, visits, expected, cached_adapters)

    def order(
        self,
        candidates: list[Candidate],
        now: float,
        adapter_visits: Mapping[Hashable, int],
        cached_adapters: int,
    ) -> list[Candidate]:
        """The candidates, first to leave first (see `context`)."""
        ctx = self.context(candidates, now, adapter_visits, cached_adapters)
        return self.policy.order(candidates, ctx)
