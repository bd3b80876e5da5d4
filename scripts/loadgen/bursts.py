"""Bursty arrivals shaped like Azure's LLM inference trace: a model of its shape, not the trace.

The Azure LLM inference trace 2023 (AzurePublicDataset, `AzureLLMInferenceTrace_code.csv` and
`_conv.csv`, one hour of a code-completion and of a conversation service on 2023-11-16, the
trace of Patel et al., "Splitwise", ISCA 2024; CC-BY) is burstier than Poisson at every time
scale: in the code trace 56% of 10 s windows receive nothing while others get several times
the mean, and the conversation trace's rate drifts over minutes (the variance of its
per-window counts over their mean grows from 3.9 at 10 s to 56 at 300 s; Poisson's is 1). The
trace itself is not shipped here; `BurstShape` models it as a Markov-modulated Gamma process:

- Time runs in windows that each hold `window_requests` arrivals on average (the trace's 10 s
  windows at its own mean rate); at another rate the window stretches or shrinks so that a
  burst still holds as many requests as the trace's do.
- A window is on or off (a two-state Markov chain: an off window stays off with `stay_off`, an
  on one stays on with `stay_on`); an off window gets no arrival.
- An on window's rate is the mean rate times exp(x - sigma^2 / 2) / P(on), with x a Gaussian
  AR(1) over on windows (stationary std `sigma`, lag-one correlation `rho`), so that the
  long-run rate is the one asked for.
- Within the windows, arrivals are a Gamma renewal process in "expected arrivals" time (gaps
  of coefficient of variation `gap_cv`), so that gaps carry across window edges.

The parameters were measured on the two CSV files (8,819 and 19,366 requests) with
bench/fit_azure_arrivals.py, which recomputes them from the files and compares the model with
them: drawn at the trace's own rate, the code shape's counts have a variance over mean of 58 /
131 / 237 at 10 / 60 / 300 s (the trace: 72 / 164 / 138) and 48% empty 10 s windows (56%); the
conversation shape's 5.3 / 16 / 33 (3.9 / 16 / 56). One hour of each trace is all there is to
fit, so the model's longer scales are loose.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BurstShape:
    """A Markov-modulated Gamma arrival process (see the module docstring)."""

    window_requests: float  # mean arrivals per window
    stay_off: float  # P(off -> off)
    stay_on: float  # P(on -> on)
    sigma: float  # stationary std of an on window's log-rate
    rho: float  # lag-one correlation of the log-rate over consecutive on windows
    gap_cv: float  # coefficient of variation of the gaps within windows

    @property
    def share_on(self) -> float:
        """The stationary share of on windows."""
        leave_off, leave_on = 1.0 - self.stay_off, 1.0 - self.stay_on
        return 1.0 if leave_on == 0 else leave_off / (leave_off + leave_on)


# Measured on AzurePublicDataset's data/AzureLLMInferenceTrace_{code,conv}.csv (10 s windows).
AZURE_SHAPES = {
    "azure-code": BurstShape(25.7, 0.798, 0.738, 0.77, 0.04, 2.17),
    "azure-conv": BurstShape(55.3, 0.0, 1.0, 0.26, 0.82, 1.01),
}


def burst_arrivals(
    shape: BurstShape,
    rps: float,
    rng: random.Random,
    num_requests: int | None,
    duration_s: float | None,
) -> list[float]:
    """Arrival offsets (s) of `shape` at a long-run mean of `rps`, within the bounds given."""
    window_s = shape.window_requests / rps
    k = 1.0 / (shape.gap_cv * shape.gap_cv)  # Gamma shape of a gap; its mean is one arrival
    share_on = shape.share_on
    limit = num_requests if num_requests is not None else math.inf
    end = duration_s if duration_s is not None else math.inf
    times: list[float] = []
    is_on = rng.random() < share_on
    x = rng.gauss(0.0, shape.sigma)
    start = 0.0
    gap = rng.gammavariate(k, 1.0 / k)  # in expected arrivals
    while len(times) < limit and start < end:
        if is_on:
            rate = rps * math.exp(x - shape.sigma**2 / 2) / share_on  # arrivals/s in this window
            room = rate * window_s  # expected arrivals in this window
            used = 0.0
            while used + gap <= room and len(times) < limit:
                used += gap
                when = start + used / rate
                if when >= end:
                    return times
                times.append(when)
                gap = rng.gammavariate(k, 1.0 / k)
            gap -= room - used
            noise = rng.gauss(0.0, shape.sigma)
            x = shape.rho * x + math.sqrt(1.0 - shape.rho**2) * noise
        start += window_s
        is_on = rng.random() < (shape.stay_on if is_on else 1.0 - shape.stay_off)
    return times
