"""Per-adapter demand (tokens/s) as the scheduler observes it, for LoRAServe's placement.

Every routed request adds its prompt tokens plus its max_new_tokens to its adapter's count (the
scheduler cannot know the true output length when it routes; the simulator passes the true one
as max_new_tokens). At each placement step the counts become rates over the step, and the
estimate of an adapter's next-step demand (LoRAServe's EXTRAPOLATE) is an exponential moving
average of its rates, `smoothing` being the weight of the last step: recent drift counts most,
one quiet step does not drop a steady adapter. An adapter without an estimate starts from 0, not
from its first rate: the long tail of adapters seen once in a while would otherwise count in
full at each appearance and inflate the total (placement uses demand relative to the total, so
the damped start of a newly hot adapter costs less than that bias). Estimates below `floor`
tokens/s are dropped (the
adapter has no demand: placement keeps it where it is).

Thread-safe: the router records from many request threads while the placement loop rolls.
"""

from __future__ import annotations

import threading
from collections import defaultdict


class DemandTracker:
    def __init__(self, smoothing: float = 0.5, floor: float = 1e-3):
        if not 0 < smoothing <= 1 or floor < 0:
            raise ValueError("smoothing must be in (0, 1] and floor >= 0")
        self.smoothing = smoothing
        self.floor = floor
        self._lock = threading.Lock()
        self._tokens: dict[str, float] = defaultdict(float)
        self._estimate: dict[str, float] = {}
        self._ranks: dict[str, int] = {}
        self._num_requests = 0
        self._sum_prompt = 0.0
        self._sum_output = 0.0

    def record(self, adapter: str, rank: int, prompt_tokens: int, max_new_tokens: int) -> None:
        """One routed request for `adapter` (of `rank`)."""
        with self._lock:
            self._tokens[adapter] += prompt_tokens + max_new_tokens
            self._ranks[adapter] = rank
            self._num_requests += 1
            self._sum_prompt += prompt_tokens
            self._sum_output += max_new_tokens

    def roll(self, elapsed_s: float) -> dict[str, float]:
        """End a step of `elapsed_s` seconds: fold its rates in; return the estimates."""
        if elapsed_s <= 0:
            raise ValueError("a step must last a positive time")
        with self._lock:
            tokens, self._tokens = self._tokens, defaultdict(float)
            alpha = self.smoothing
            estimate = {}
            for adapter in set(tokens) | set(self._estimate):
                rate = tokens.get(adapter, 0.0) / elapsed_s
                value = alpha * rate + (1 - alpha) * self._estimate.get(adapter, 0.0)
                if value >= self.floor:
                    estimate[adapter] = value
            self._estimate = estimate
            return dict(estimate)

    def ranks(self) -> dict[str, int]:
        """Rank of each adapter seen so far."""
        with self._lock:
            return dict(self._ranks)

    def mean_lengths(self) -> tuple[float, float] | None:
        """(mean prompt tokens, mean max_new_tokens) over every request seen, or None."""
        with self._lock:
            if not self._num_requests:
                return None
            return self._sum_prompt / self._num_requests, self._sum_output / self._num_requests
