"""The fit behind the loadgen's Azure-shaped arrivals: it reads Azure's CSV format and finds a
known shape back from arrivals drawn from it."""

from __future__ import annotations

import datetime
import random

import pytest

from bench.fit_azure_arrivals import burstiness, fit, main, read_times
from toppings.scripts.loadgen.bursts import AZURE_SHAPES, BurstShape, burst_arrivals


def write_csv(path, times: list[float]) -> None:
    """Times in Azure's layout: 7 fractional digits, token columns beside."""
    origin = datetime.datetime(2023, 11, 16, 18, 15, 46)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for t in times:
        stamp = (origin + datetime.timedelta(seconds=t)).strftime("%Y-%m-%d %H:%M:%S.%f")
        lines.append(f"{stamp}0,374,44")
    path.write_text("\n".join(lines) + "\n")


def test_a_shape_is_found_back_from_its_own_arrivals(tmp_path):
    shape = BurstShape(30.0, 0.7, 0.8, 0.6, 0.5, 1.5)
    rps = 3.0
    times = burst_arrivals(shape, rps, random.Random(4), 100_000, None)
    write_csv(tmp_path / "trace.csv", times)
    read = read_times(str(tmp_path / "trace.csv"))
    assert len(read) == len(times) and read[0] == 0.0
    assert read[-1] == pytest.approx(times[-1] - times[0], abs=1e-3)
    got = fit(read, window_s=shape.window_requests / rps)
    assert got.window_requests == pytest.approx(shape.window_requests, rel=0.1)
    assert got.stay_off == pytest.approx(shape.stay_off, abs=0.05)
    assert got.stay_on == pytest.approx(shape.stay_on, abs=0.05)
    assert got.sigma == pytest.approx(shape.sigma, abs=0.1)
    assert got.rho == pytest.approx(shape.rho, abs=0.1)
    assert got.gap_cv == pytest.approx(shape.gap_cv, rel=0.15)
    report = main([str(tmp_path / "trace.csv"), "--window-s", str(shape.window_requests / rps)])
    assert report[str(tmp_path / "trace.csv")]["model"]["dispersion_10s"] > 1


def test_poisson_arrivals_fit_as_unmodulated():
    rng = random.Random(1)
    times, now = [], 0.0
    for _ in range(50_000):
        now += rng.expovariate(5.0)
        times.append(now)
    got = fit(times)
    assert got.stay_on == 1.0 and got.sigma < 0.05 and got.gap_cv == pytest.approx(1.0, abs=0.05)
    assert burstiness(times)["dispersion_60s"] == pytest.approx(1.0, abs=0.3)
    assert AZURE_SHAPES["azure-conv"].stay_on == 1.0  # the conversation trace never went silent
