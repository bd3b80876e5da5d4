"""Which cached adapters to evict when a new one needs room: policies behind one interface.

A policy only orders candidates; the cache decides who is a candidate (reference count 0) and
how many bytes must be freed. Policies are picked by name from `EVICTION_POLICIES`.

`Usage` and `least_recently_used` are the one recency bookkeeping of the node: the adapter
cache keeps a `Usage` per adapter, and the server's memory pool orders its candidates (KV blocks
and adapters alike) with the same `least_recently_used`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar


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


@dataclass
class CacheStats:
    """What a policy may look at for one cached adapter."""

    name: str
    num_bytes: int
    last_used: float  # monotonic seconds of the last request that used it
    frequency: int  # requests that used it since it was registered


class EvictionPolicy:
    """Orders eviction candidates, first to go first."""

    name = "base"

    def order(self, candidates: list[CacheStats]) -> list[CacheStats]:
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently used first (ties by name)."""

    name = "lru"

    def order(self, candidates: list[CacheStats]) -> list[CacheStats]:
        return least_recently_used(sorted(candidates, key=lambda c: c.name))


class ChameleonPolicy(EvictionPolicy):
    """Chameleon (MICRO'25): Score = 0.45 F + 0.10 R + 0.45 S, lowest score evicted first.

    F (frequency), R (recency) and S (size) are each normalised to [0, 1] over the candidates;
    a large adapter scores high because reloading it costs more.
    """

    name = "chameleon"
    weights = (0.45, 0.10, 0.45)

    def order(self, candidates: list[CacheStats]) -> list[CacheStats]:
        if not candidates:
            return []
        freq = _normalise([c.frequency for c in candidates])
        recency = _normalise([c.last_used for c in candidates])
        size = _normalise([c.num_bytes for c in candidates])
        wf, wr, ws = self.weights
        scores = {
            c.name: wf * f + wr * r + ws * s for c, f, r, s in zip(candidates, freq, recency, size)
        }
        return sorted(candidates, key=lambda c: (scores[c.name], c.last_used, c.name))


def _normalise(values: list[float]) -> list[float]:
    """Min-max to [0, 1]; all equal -> all 0."""
    lo, hi = min(values), max(values)
    if hi == lo:
        return [0.0] * len(values)
    return [(v - lo) / (hi - lo) for v in values]


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    ChameleonPolicy.name: ChameleonPolicy,
}


def make_by_name(table: Mapping[str, Callable[[], P]], name: str, what: str) -> P:
    """A new instance of the class `table` holds under `name`; ValueError naming the choices."""
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; choose {sorted(table)}")
    return table[name]()


def make_policy(name: str) -> EvictionPolicy:
    return make_by_name(EVICTION_POLICIES, name, "eviction policy")
