"""Which cached adapters to evict when a new one needs room: policies behind one interface.

A policy only orders candidates; the cache decides who is a candidate (reference count 0) and
how many bytes must be freed. Policies are picked by name from `EVICTION_POLICIES`.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    """Least recently used first."""

    name = "lru"

    def order(self, candidates: list[CacheStats]) -> list[CacheStats]:
        return sorted(candidates, key=lambda c: (c.last_used, c.name))


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


def make_policy(name: str) -> EvictionPolicy:
    if name not in EVICTION_POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose {sorted(EVICTION_POLICIES)}")
    return EVICTION_POLICIES[name]()
