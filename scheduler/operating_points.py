"""LoRAServe's operating points: the most tokens/s one server sustains under the SLO when every
request it serves uses an adapter of one rank, derived from the fitted perf models (Eq. 2).

LoRAServe profiles each rank on a real server; we derive the same number from the iteration
models the rank-aware policy already routes on, so that both policies share one description of
the hardware. A server that keeps n requests of rank R in its batch, with mean prompt P and mean
output O tokens, alternates decode iterations D(n) (all n requests, one token each) with the
prefill of each newcomer, Pf (one prompt of P tokens, alone: at the loads we look at, less than
one request arrives per iteration). One "generation" of n requests takes

    T(n) = O * D(n) + n * Pf          (O decode iterations, n prefills)

so the server finishes n / T(n) requests per second, i.e. n (P + O) / T(n) tokens per second,
and each request sees a time per token of about T(n) / O = D(n) + n Pf / O. The operating point
of rank R is the throughput at the largest n whose time per token stays within
`headroom x SLO` (and within the batch and KV limits). The headroom (< 1) leaves room for the
queueing that Poisson arrivals cause near the boundary; its value scales every rank alike, so
budgets (ratios of operating points) barely depend on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from toppings.scheduler.perf_model import PerfModels
from toppings.scheduler.state import BatchShape


@dataclass(frozen=True)
class OperatingPointConfig:
    """Server limits and the request shape the operating points are computed for."""

    slo_ms: float
    kernel: str = "bgmv"
    mean_prompt_tokens: float = 69.5
    mean_output_tokens: float = 214.5
    max_batch_size: int = 128
    max_total_tokens: int = 40_000
    headroom: float = 0.9

    def __post_init__(self) -> None:
        if self.slo_ms <= 0 or self.mean_output_tokens < 1 or self.mean_prompt_tokens < 1:
            raise ValueError("slo_ms must be positive and the mean lengths at least 1 token")
        if self.max_batch_size < 1 or self.max_total_tokens < 1:
            raise ValueError("max_batch_size and max_total_tokens must be positive")
        if not 0 < self.headroom <= 1:
            raise ValueError("headroom must be in (0, 1]")


def operating_point(perf: PerfModels, config: OperatingPointConfig, rank: int) -> float:
    """Tokens/s (prompt + output) one server sustains with rank-`rank` requests only.

    Never below the throughput of a single request, so every rank gets a positive point even
    when one request alone misses the SLO (the placement then gives that rank its own servers).
    """
    decode = perf.decode(config.kernel)
    prefill = perf.prefill(config.kernel)
    prompt = max(1, round(config.mean_prompt_tokens))
    out = config.mean_output_tokens
    prefill_ms = prefill.predict(BatchShape.of([rank], [prompt]))
    per_request_tokens = prompt + out
    max_n = min(config.max_batch_size, int(config.max_total_tokens // per_request_tokens) or 1)
    bound_ms = config.headroom * config.slo_ms
    best = 0.0
    for n in range(1, max_n + 1):
        shape = BatchShape(n, n * rank, rank, n * prompt, n * prompt * rank)
        cycle_ms = out * decode.predict(shape) + n * prefill_ms  # T(n)
        tokens_per_s = 1000.0 * n * per_request_tokens / cycle_ms
        if n > 1 and cycle_ms / out > bound_ms:
            break
        best = max(best, tokens_per_s)
    return best


def batch_at(perf: PerfModels, config: OperatingPointConfig, rank: int, tokens_per_s: float) -> int:
    """The batch size n at which the model above delivers `tokens_per_s` with rank-`rank`
    requests: the smallest n whose n (P + O) / T(n) reaches it (the largest allowed n when none
    does). By Little's law, a server kept above it holds more requests than its operating point
    can turn over; the router reads it as "past the operating point" (scheduler/policies/)."""
    decode = perf.decode(config.kernel)
    prompt = max(1, round(config.mean_prompt_tokens))
    out = config.mean_output_tokens
    prefill_ms = perf.prefill(config.kernel).predict(BatchShape.of([rank], [prompt]))
    per_request_tokens = prompt + out
    max_n = min(config.max_batch_size, int(config.max_total_tokens // per_request_tokens) or 1)
    for n in range(1, max_n + 1):
        shape = BatchShape(n, n * rank, rank, n * prompt, n * prompt * rank)
        cycle_ms = out * decode.predict(shape) + n * prefill_ms
        if 1000.0 * n * per_request_tokens / cycle_ms >= tokens_per_s:
            return n
    return max_n


def operating_points(
    perf: PerfModels, config: OperatingPointConfig, ranks: Iterable[int]
) -> dict[int, float]:
    """rank -> tokens/s, for each distinct rank."""
    return {rank: operating_point(perf, config, rank) for rank in sorted(set(ranks))}
