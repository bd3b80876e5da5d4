"""A histogram of adapter load times: from a load's submission (the moment a request asks for
the adapter) until its last layer group is on the device, queueing behind earlier loads
included, since that is what the request waits for under a mode that waits for whole adapters.

Fed once per finished load by its `LoadTicket` (from the loader thread on a CPU device, or the
first thread that sees the last CUDA event complete); read at scrape time by `/stats` and
`/metrics`. Failed loads are not observed.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

# Seconds: a small adapter over an unthrottled copy takes a millisecond, a rank-256 adapter of a
# 70B model over an emulated slow link several seconds.
LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class LoadTimesView:
    """Cumulative counts per upper bound (the last bound is +inf), their sum and count."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]  # loads that took at most bounds[i] seconds
    sum_s: float
    count: int

    def to_json(self) -> dict:
        """The /stats shape: {"bounds": [float, ...], "cumulative": [int, ...], "sum_s",
        "count"}; the +inf bound is left out (its count is "count")."""
        return {"bounds": list(self.bounds), "cumulative": list(self.cumulative),
                "sum_s": self.sum_s, "count": self.count}  # fmt: skip


class LoadTimes:
    """Thread-safe fixed-bucket histogram of load durations (seconds)."""

    def __init__(self, bounds: tuple[float, ...] = LOAD_BUCKETS):
        if list(bounds) != sorted(bounds) or not bounds:
            raise ValueError("bounds must be increasing")
        self.bounds = tuple(bounds)
        self._counts = [0] * len(bounds)  # per bucket, not cumulative; the rest fall into +inf
        self._sum_s = 0.0
        self._count = 0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        idx = bisect.bisect_left(self.bounds, seconds)
        with self._lock:
            if idx < len(self._counts):
                self._counts[idx] += 1
            self._sum_s += seconds
            self._count += 1

    def view(self) -> LoadTimesView:
        with self._lock:
            counts, sum_s, count = list(self._counts), self._sum_s, self._count
        cumulative, total = [], 0
        for c in counts:
            total += c
            cumulative.append(total)
        return LoadTimesView(self.bounds, tuple(cumulative), sum_s, count)
