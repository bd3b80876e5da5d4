"""Chameleon's sizing arithmetic (MICRO'25, sec. 4.3): request size, queue cutoffs, quotas.

Pure functions and one small predictor, no engine state, so each formula is tested alone.

- Weighted request size: WRS = (0.4 in/maxIn + 0.6 out/maxOut) * adapter/maxAdapter.
- Output length: predicted per adapter from the lengths it actually produced: the request's
  max_new_tokens times the mean share of max_new_tokens that the adapter's last 32 completed
  requests used (all adapters' share for an adapter not seen yet; 1 before anything finished),
  so never above the request's max_new_tokens.
- Queues: 1-D K-means for K = 1..4 over recent WRS values; cutoffs at the midpoints between
  consecutive centroids.
- Quotas: the M/M/1 bound Tok_min >= S * D * (1/SLO + lambda) per queue; what is left of the
  total is split in proportion to each queue's token demand. In KV slots held while a request
  runs (`queue_quotas`), or in tokens of every step (`step_quotas`, chunked prefill).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict, deque

from toppings.server.requests.adapter_ref import AdapterRef

WRS_INPUT_WEIGHT = 0.4  # A in the paper
WRS_OUTPUT_WEIGHT = 0.6  # B in the paper
MAX_QUEUES = 4  # K_max
EXPLAINED = 0.9  # stop adding queues once they explain 90% of the size variance
MIN_CLUSTER_SHARE = 0.05  # a queue for fewer than 5% of the requests is not worth its quota
HISTORY = 32  # completed requests per adapter the output predictor remembers
BOUND_QUANTILE = 0.9  # the share of max_new_tokens `OutputPredictor.bound` expects
BOUND_MIN_HISTORY = 8  # requests that ended before a bound is read from them
DEFAULT_TOKEN_S = 0.05  # seconds per output token before any request has completed


def weighted_request_size(
    in_tokens: int,
    out_tokens: float,
    adapter_size: float,
    max_in: float,
    max_out: float,
    max_adapter: float,
) -> float:
    """WRS of one request; each ratio is clipped to [0, 1] (a maximum may be stale)."""

    def ratio(x: float, top: float) -> float:
        return min(x / top, 1.0) if top > 0 else 1.0

    length = WRS_INPUT_WEIGHT * ratio(in_tokens, max_in) + WRS_OUTPUT_WEIGHT * ratio(
        out_tokens, max_out
    )
    return length * ratio(adapter_size, max_adapter)


class OutputPredictor:
    """Predicts a request's output length from what its adapter produced before: the request's
    max_new_tokens times the share of max_new_tokens its adapter's recent requests used."""

    def __init__(self, history: int = HISTORY):
        self._per_adapter: dict[AdapterRef | None, deque[float]] = defaultdict(
            lambda: deque(maxlen=history)
        )
        self._all: deque[float] = deque(maxlen=8 * history)

    def observe(self, adapter: AdapterRef | None, num_tokens: int, max_new_tokens: int) -> None:
        """A request of `adapter` completed with `num_tokens` of its `max_new_tokens`."""
        share = min(num_tokens / max(max_new_tokens, 1), 1.0)
        self._per_adapter[adapter].append(share)
        self._all.append(share)

    @property
    def num_adapters(self) -> int:
        """Adapters (the base model counts as one) with a history kept."""
        return len(self._per_adapter)

    def forget(self, adapter: AdapterRef) -> None:
        """`adapter` was unloaded: its history goes (a reload has a new reference)."""
        self._per_adapter.pop(adapter, None)

    def predict(self, adapter: AdapterRef | None, max_new_tokens: int) -> float:
        seen = self._per_adapter.get(adapter) or self._all
        share = sum(seen) / len(seen) if seen else 1.0
        return share * max_new_tokens

    def bound(self, adapter: AdapterRef | None, params) -> int:
        """Output tokens a request of `adapter` with these sampling params is expected to make
        at most: max_new_tokens times the BOUND_QUANTILE share of its adapter's recent
        requests (of all adapters' while it has fewer than BOUND_MIN_HISTORY, all of
        max_new_tokens while they have too), and at least what the request guarantees."""
        seen = self._per_adapter.get(adapter)
        if seen is None or len(seen) < BOUND_MIN_HISTORY:
            seen = self._all
        if len(seen) < BOUND_MIN_HISTORY:
            return params.max_new_tokens
        share = sorted(seen)[math.ceil(BOUND_QUANTILE * len(seen)) - 1]
        expected = math.ceil(share * params.max_new_tokens)
        return min(max(expected, guaranteed_output(params)), params.max_new_tokens)


def guaranteed_output(params) -> int:
    """Output tokens a request makes whatever its adapter's history says: `min_tokens`, and all
    of `max_new_tokens` where nothing but its length stops it (ignore_eos without stops, no
    constraint)."""
    if params.ignore_eos and not (params.stop or params.stop_token_ids or params.constraint):
        return params.max_new_tokens
    return min(params.min_tokens, params.max_new_tokens)


def kmeans_1d(values: list[float], k: int, iterations: int = 50) -> tuple[list[float], float]:
    """Lloyd's K-means on numbers, seeded at the quantiles (deterministic).

    Returns (sorted centroids, within-cluster sum of squares); empty clusters are dropped.
    """
    xs = sorted(values)
    n = len(xs)
    centroids = sorted({xs[min(n - 1, int((i + 0.5) * n / k))] for i in range(k)})
    for _ in range(iterations):
        cuts = midpoints(centroids)
        groups: list[list[float]] = [[] for _ in centroids]
        for x in xs:
            groups[bisect.bisect_right(cuts, x)].append(x)
        new = sorted(sum(g) / len(g) for g in groups if g)
        if new == centroids:
            break
        centroids = new
    cuts = midpoints(centroids)
    wcss = sum((x - centroids[bisect.bisect_right(cuts, x)]) ** 2 for x in xs)
    return centroids, wcss


def midpoints(centroids: list[float]) -> list[float]:
    """Cutoffs between consecutive sorted centroids: queue i takes cut[i-1] <= WRS < cut[i]."""
    return [(a + b) / 2 for a, b in zip(centroids, centroids[1:])]


def queue_cutoffs(values: list[float], max_queues: int = MAX_QUEUES) -> list[float]:
    """The cutoffs of K <= max_queues queues for these WRS values (K - 1 numbers, ascending).

    The paper picks the K of minimal WCSS, which taken literally is always K_max (WCSS never
    grows with K); we take the elbow instead: the smallest K whose clusters explain 90% of the
    variance (WCSS(K) <= 0.1 WCSS(1)), K_max if none does, and never a K with a cluster of
    fewer than 5% of the values (a queue that small is not worth its quota).
    """
    if len(set(values)) < 2:
        return []
    total = kmeans_1d(values, 1)[1]
    best: list[float] = []
    for k in range(2, max_queues + 1):
        centroids, wcss = kmeans_1d(values, k)
        cuts = midpoints(centroids)
        counts = [0] * len(centroids)
        for x in values:
            counts[bisect.bisect_right(cuts, x)] += 1
        if len(centroids) < k or min(counts) < MIN_CLUSTER_SHARE * len(values):
            break
        best = cuts
        if wcss <= (1 - EXPLAINED) * total:
            break
    return best


def min_quota_tokens(max_size: float, duration_s: float, slo_s: float, rate: float) -> float:
    """Tok_min = S * D * (1/SLO + lambda): the tokens a queue needs so that an M/M/1 queue
    served at mu = Tok / (S * D) keeps its time in system 1 / (mu - lambda) within the SLO.

    max_size: S, tokens of the largest request of the queue; duration_s: D, seconds a request
    of the queue runs; slo_s: the TTFT SLO; rate: lambda, its arrivals per second.
    """
    return max_size * duration_s * (1.0 / slo_s + rate)


def split_quotas(
    minimums: list[float], demands: list[float], total: int, floors: list[float] | None = None
) -> list[int]:
    """Each queue's quota: its minimum, plus the rest of `total` in proportion to `demands`.

    When the minimums exceed the total (the SLO cannot be met at this load) each queue first
    gets its floor (the charge of its largest request, so that one of them fits its quota and
    the queue is not reduced to one request at a time), and what is left of the total is
    shared in proportion to what each still needs (all scaled down when even the floors do
    not fit).
    """
    need = sum(minimums)
    if need >= total:
        if need <= 0:
            return [0] * len(minimums)
        floors = [min(f, m) for f, m in zip(floors or [0.0] * len(minimums), minimums)]
        base = sum(floors)
        if base >= total:
            return [int(total * f / base) for f in floors]
        rest = need - base
        return [int(f + (total - base) * (m - f) / rest) for f, m in zip(floors, minimums)]
    spare = total - need
    weight = sum(demands) or len(demands)
    shares = demands if sum(demands) else [1.0] * len(demands)
    return [int(m + spare * s / weight) for m, s in zip(minimums, shares)]


def queue_quotas(
    arrivals: list[tuple[int, object]],
    served: list[tuple[int, float, int]],
    num_queues: int,
    total: int,
    slo_s: float,
    now: float,
) -> list[int]:
    """Each queue's quota of `total` from recent traffic.

    arrivals: (queue, size) of recent arrivals; a size has `arrived` (s), `charge` (tokens)
    and `out_tokens` (predicted); served: (queue, seconds it ran, output tokens) of recent
    completions. Per queue: lambda = arrivals / span, D = mean run time (or predicted output
    times the mean seconds per token before any of its requests completed), S = its largest
    charge; minimum Tok_min = S * D * (1/SLO + lambda), floor S, demand lambda * D * mean charge.
    """
    span = max(now - min(s.arrived for _, s in arrivals), 1e-3)
    token_s = seconds_per_token(served)
    minimums, demands, floors = [], [], []
    for q in range(num_queues):
        mine = [s for i, s in arrivals if i == q]
        runs = [t for i, t, _ in served if i == q]
        if not mine:
            minimums.append(0.0)
            demands.append(0.0)
            floors.append(0.0)
            continue
        if runs:
            duration = sum(runs) / len(runs)
        else:
            duration = token_s * sum(s.out_tokens for s in mine) / len(mine)
        rate = len(mine) / span
        charge = max(s.charge for s in mine)
        minimums.append(min_quota_tokens(charge, duration, slo_s, rate))
        demands.append(rate * duration * sum(s.charge for s in mine) / len(mine))
        floors.append(charge)
    return split_quotas(minimums, demands, total, floors)


def seconds_per_token(served: list[tuple[int, float, int]]) -> float:
    """Seconds per output token of recent completions ((queue, seconds, tokens) each); one
    token per running request per step, so also the seconds a step takes."""
    if not served:
        return DEFAULT_TOKEN_S
    return sum(t for _, t, _ in served) / max(sum(n for *_, n in served), 1)


def step_quotas(
    arrivals: list[tuple[int, object]],
    served: list[tuple[int, float, int]],
    num_queues: int,
    budget: int,
    slo_s: float,
    now: float,
) -> list[int]:
    """Each queue's quota of the `budget` tokens one step computes, from recent traffic.

    A queue holding Tok tokens of every step finishes a request of W tokens (its prompt plus
    its predicted output, each computed once) every W / Tok steps: an M/M/1 server at
    mu = Tok / (W * tau), tau the seconds a step takes (`seconds_per_token`). So the paper's
    bound holds with S = W and D = tau: Tok_min = W_max * tau * (1/SLO + lambda); its demand is
    the tokens its arrivals bring per step, lambda * tau * mean W; its floor one token.
    arrivals: (queue, size) with `arrived`, `in_tokens` and `out_tokens`; served as in
    `queue_quotas`.
    """
    span = max(now - min(s.arrived for _, s in arrivals), 1e-3)
    step_s = seconds_per_token(served)
    minimums, demands, floors = [], [], []
    for q in range(num_queues):
        work = [s.in_tokens + s.out_tokens for i, s in arrivals if i == q]
        if not work:
            minimums.append(0.0)
            demands.append(0.0)
            floors.append(0.0)
            continue
        rate = len(work) / span
        minimums.append(min_quota_tokens(max(work), step_s, slo_s, rate))
        demands.append(rate * step_s * sum(work) / len(work))
        floors.append(1.0)
    return split_quotas(minimums, demands, budget, floors)
