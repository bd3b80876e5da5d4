"""Perf-model forms: the "batch" form fits a base cost growing with |S| that Eq. 2 cannot, and a
fitted model of either form survives a JSON round trip with its feature names."""

from __future__ import annotations

import random

import pytest

from toppings.scheduler.perf_model import FORMS, LinearPerfModel, PerfModels, fit_from_samples
from toppings.scheduler.state import BatchShape

RANKS = (8, 16, 32, 64)


def cpu_like_decode(seed: int, num: int = 150) -> list[dict]:
    """Decode iterations costing 20 + 2|S| + 0.05 sum r + 0.002 |S| sum r ms (CPU-like)."""
    rng = random.Random(seed)
    samples = []
    for _ in range(num):
        ranks = [rng.choice(RANKS) for _ in range(rng.choice((1, 2, 4, 8, 16, 24, 32)))]
        n, sum_rank = len(ranks), sum(ranks)
        latency = 20.0 + 2.0 * n + 0.05 * sum_rank + 0.002 * n * sum_rank
        samples.append({"kernel": "mbgmv", "phase": "decode", "ranks": ranks,
                        "latency_ms": latency + rng.gauss(0.0, 0.5)})  # fmt: skip
    return samples


def test_batch_form_recovers_a_cost_that_eq2_misses():
    samples = cpu_like_decode(seed=0)
    eq2 = fit_from_samples(samples).decode("mbgmv")
    batch = fit_from_samples(samples, form="batch").decode("mbgmv")
    assert eq2.feature_names == ("sum_rank",)
    assert batch.feature_names == FORMS["batch"][("mbgmv", "decode")]
    assert batch.intercept == pytest.approx(20.0, abs=1.0)
    assert batch.coefficients == pytest.approx((2.0, 0.05, 0.002), rel=0.1)
    assert batch.r2 > 0.99 and eq2.r2 < batch.r2 - 0.01
    shape = BatchShape.of([64] * 32, [0] * 32)
    assert batch.predict(shape) == pytest.approx(20 + 64 + 0.05 * 2048 + 0.002 * 32 * 2048, 0.02)


def test_forms_round_trip_and_bad_files_are_refused(tmp_path):
    samples = cpu_like_decode(seed=1)
    models = fit_from_samples(samples, form="batch")
    path = tmp_path / "pm.json"
    models.save(path)
    again = PerfModels.load(path)
    shape = BatchShape.of([8, 64, 16], [10, 20, 30])
    assert again.decode("mbgmv").feature_names == models.decode("mbgmv").feature_names
    assert again.decode("mbgmv").predict(shape) == pytest.approx(
        models.decode("mbgmv").predict(shape)
    )
    text = path.read_text().replace('"num_x_sum_rank"', '"num_cubed"')
    path.write_text(text)
    with pytest.raises(ValueError, match="not ours"):
        PerfModels.load(path)
    with pytest.raises(ValueError, match="unknown form"):
        fit_from_samples(samples, form="cubic")
    with pytest.raises(ValueError, match="unknown features"):
        LinearPerfModel("bgmv", "decode", 1.0, (1.0,), features=("num_cubed",))
