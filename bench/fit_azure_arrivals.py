"""Fit the loadgen's bursty arrival shape (scripts.loadgen.bursts.BurstShape) to an arrival trace.

The shapes `azure-code` and `azure-conv` of `toppings-loadgen --arrivals` were measured with this
on AzurePublicDataset's data/AzureLLMInferenceTrace_code.csv and _conv.csv (the Azure LLM
inference trace 2023, CC-BY; not shipped here). Given such a CSV (a TIMESTAMP column of
`YYYY-MM-DD HH:MM:SS.fffffff` times), it prints the fitted shape and, for a check of the model
against the trace, the variance over the mean of the per-window arrival counts at 10 s, 60 s and
300 s (1 for Poisson) and the share of empty 10 s windows, of the trace and of arrivals drawn
from the fitted shape at the trace's own rate.

    python -m bench.fit_azure_arrivals AzureLLMInferenceTrace_code.csv [--window-s 10]

The fit, over windows of `--window-s`: the chain's stay probabilities from consecutive windows'
being empty or not; gap_cv from the gaps between arrivals of the same window, each scaled by its
window's rate; sigma from the variance of the log counts of non-empty windows less the part a
renewal count adds around its rate (gap_cv^2 / count); rho, their lag-one covariance over
consecutive non-empty windows over that variance.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np

from toppings.scripts.loadgen.bursts import BurstShape, burst_arrivals

SCALES_S = (10.0, 60.0, 300.0)


def read_times(path: str) -> list[float]:
    """Arrival offsets (s) from the first, sorted, of a CSV with a TIMESTAMP column."""
    with open(path) as f:
        header = f.readline().strip().split(",")
        col = header.index("TIMESTAMP")
        stamps = [line.split(",")[col] for line in f if line.strip()]
    fmt = "%Y-%m-%d %H:%M:%S.%f"
    # Azure writes 7 fractional digits; strptime takes at most 6
    seconds = sorted(datetime.datetime.strptime(s[:26], fmt).timestamp() for s in stamps)
    return [s - seconds[0] for s in seconds]


def fit(times: Sequence[float], window_s: float = 10.0) -> BurstShape:
    """The BurstShape of sorted arrival offsets `times` over windows of `window_s` (the last,
    partial window left out)."""
    t = np.asarray(times, dtype=float)
    idx = (t // window_s).astype(int)
    counts = np.bincount(idx)[:-1]
    on = counts > 0
    was_on, now_on = on[:-1], on[1:]
    stay_on = float(np.mean(now_on[was_on]))
    stay_off = float(np.mean(~now_on[~was_on])) if (~was_on).any() else 0.0
    same = (idx[1:] == idx[:-1]) & (idx[1:] < len(counts))
    gaps = np.diff(t)[same] * counts[idx[1:][same]] / window_s  # in mean gaps of the window
    gap_cv = float(gaps.std() / gaps.mean())
    # A window's count varies with its rate and, around it, as a renewal count does (variance
    # gap_cv^2 x the count): that part of the log counts' (co)variance is taken out.
    logs = np.log(np.where(on, counts, 1) / counts[on].mean())
    noise = float(np.mean(gap_cv**2 / counts[on]))
    variance = max(float(logs[on].var()) - noise, 1e-9)
    both = was_on & now_on
    centred = logs - logs[on].mean()
    rho = float(np.mean(centred[:-1][both] * centred[1:][both])) / variance if both.any() else 0.0
    rate = len(t) / t[-1]
    return BurstShape(
        window_requests=round(rate * window_s, 1),
        stay_off=round(stay_off, 3),
        stay_on=round(stay_on, 3),
        sigma=round(math.sqrt(variance), 2),
        rho=round(min(max(rho, 0.0), 1.0), 2),
        gap_cv=round(gap_cv, 2),
    )


def burstiness(times: Sequence[float]) -> dict:
    """Variance over mean of the per-window counts at SCALES_S, and the share of empty 10 s
    windows."""
    t = np.asarray(times, dtype=float)
    out = {}
    for scale in SCALES_S:
        counts = np.bincount((t // scale).astype(int))[:-1]  # the last window is partial
        out[f"dispersion_{scale:g}s"] = round(float(counts.var() / counts.mean()), 1)
    tens = np.bincount((t // 10.0).astype(int))[:-1]
    out["empty_share_10s"] = round(float(np.mean(tens == 0)), 3)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", nargs="+", help="trace CSV files with a TIMESTAMP column")
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    report = {}
    for path in args.csv:
        times = read_times(path)
        shape = fit(times, args.window_s)
        rate = len(times) / times[-1]
        model = burst_arrivals(shape, rate, random.Random(args.seed), len(times), None)
        report[path] = {"num_requests": len(times), "rate_rps": round(rate, 3),
                        "shape": asdict(shape), "trace": burstiness(times),
                        "model": burstiness(model)}  # fmt: skip
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
