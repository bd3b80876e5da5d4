"""One-off profile of one core at the model's shapes: how many tokens a worker should get.

A worker handed n tokens costs compute(n) + overhead (the invocation round trip), so its
throughput is n / (compute(n) + overhead). Small n wastes the core on overhead; beyond the
point where the throughput is within `efficiency` of its best, more tokens per core only
lengthen the call. That point is c, the tokens per core (Toppings §4).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CoreProfile:
    """Single-core LoRA compute time per token count, the invocation overhead, and c."""

    token_counts: tuple[int, ...]
    compute_us: tuple[float, ...]  # one call of the profiled modules on one core
    overhead_us: float
    tokens_per_core: int

    def tokens_per_ms(self) -> dict[int, float]:
        return {
            n: n / (us + self.overhead_us) * 1e3
            for n, us in zip(self.token_counts, self.compute_us)
        }


def time_one_core(
    shapes: list[tuple[int, int]],
    rank: int,
    dtype: torch.dtype,
    token_counts: tuple[int, ...],
    repeats: int = 5,
) -> list[float]:
    """Fastest of `repeats` timings (us) of `scale * x @ A.T @ B^T` for all projections, one thread.

    The minimum, not the median: on a shared machine the rest is other processes' noise.

    Args:
        shapes: (H_in, H_out) of the projections of one job (they share H_in).
        rank: R of the random adapter timed.
        token_counts: the n values timed.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        h_in = shapes[0][0]
        weights = [
            (torch.randn(rank, h_in).to(dtype), torch.randn(rank, o).to(dtype)) for _, o in shapes
        ]
        times = []
        for n in token_counts:
            x = torch.randn(n, h_in).to(dtype)  # [n, H_in]
            outs = [torch.empty(n, o, dtype=dtype) for _, o in shapes]
            samples = []
            for _ in range(repeats + 1):
                start = time.perf_counter_ns()
                for (a, bt), out in zip(weights, outs):
                    torch.mm(torch.mm(x, a.T).mul_(0.5), bt, out=out)
                samples.append((time.perf_counter_ns() - start) / 1e3)
            times.append(min(samples[1:]))  # the first run warms the caches
        return times
    finally:
        torch.set_num_threads(threads)


def choose_tokens_per_core(
    token_counts: tuple[int, ...],
    compute_us: list[float],
    overhead_us: float,
    efficiency: float = 0.9,
) -> int:
    """Smallest n whose rate n / (compute(n) + overhead) is within `efficiency` of the best."""
    rates = [n / (us + overhead_us) for n, us in zip(token_counts, compute_us)]
    best = max(rates)
    return next(n for n, rate in zip(token_counts, rates) if rate >= efficiency * best)
