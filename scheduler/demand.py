"""Per-adapter demand (tokens/s) as the scheduler observes it, for LoRAServe's placement.

Every routed request adds its prompt tokens plus its max_new_tokens to its adapter's count (the
scheduler cannot know the true output length when it routes; the simulator passes the true one
as max_new_tokens). At each placement step the counts become rates over the step, and the
estimate of an adapter's demand over the next step (LoRAServe's EXTRAPOLATE) is Holt's linear
forecast: a level, an exponential moving average of the rates (`smoothing`: weight of the last
step), plus a trend, a moving average of the level's changes (`trend`: its weight; 0 is a plain
moving average). An adapter climbing towards the head of a drifting popularity is thus forecast
ahead of its last rate instead of behind it, and one quiet step does not drop a steady adapter.
A new adapter starts from level 0, not from its first rate: the long tail of adapters seen once
in a while would otherwise count in full at each appearance and inflate the total. Adapters
whose forecast falls below `floor` tokens/s are dropped (no demand: placement keeps them where
they are). Forecasts are never negative.

Thread-safe: the router records from many request threads while the placement loop rolls.
"""

from __future__ import annotations

import threading
from collections import defaultdict


class DemandTracker:
    def __init__(self, smoothing: float = 0.5, trend: float = 0.5, floor: float = 1e-3):
        if not 0 < smoothing <= 1 or not 0 <= trend <= 1 or floor < 0:
            raise ValueError("smoothing must be in (0, 1], trend in [0, 1] and floor >= 0")
        self.smoothing = smoothing
        self.trend = trend
        self.floor = floor
        self._lock = threading.Lock()
        self._tokens: dict[str, float] = defaultdict(float)
        self._state: dict[str, tuple[float, float]] = {}  # adapter -> (level, trend)
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
            alpha, beta = self.smoothing, self.trend
            state, forecast = {}, {}
            for adapter in sorted(set(tokens) | set(self._state)):  # a fixed order: same sums
                rate = tokens.get(adapter, 0.0) / elapsed_s
                level, slope = self._state.get(adapter, (0.0, 0.0))
                new_level = alpha * rate + (1 - alpha) * (level + slope)
                new_slope = beta * (new_level - level) + (1 - beta) * slope
                ahead = max(0.0, new_level + new_slope)
                if ahead >= self.floor or new_level >= self.floor:
                    state[adapter] = (new_level, new_slope)
                    if ahead > 0:
                        forecast[adapter] = ahead
            self._state = state
            return forecast

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
