"""Perf models: a fit on synthetic samples recovers known coefficients; JSON round trip."""

from __future__ import annotations

import random

import pytest

from toppings.scheduler.perf_model import PerfModels, fit_from_samples, sample_shape
from toppings.scheduler.state import BatchShape

RANKS = (8, 16, 32, 64)
# Known coefficients: intercept, then one per feature of perf_model.MODEL_FEATURES.
TRUTH = {
    ("bgmv", "decode"): (30.0, (0.004,)),
    ("mbgmv", "decode"): (32.0, (0.0025,)),
    ("bgmv", "prefill"): (25.0, (0.07, 0.0005)),
    ("mbgmv", "prefill"): (26.0, (0.06, 0.0003)),
}


def synthetic_samples(seed: int, per_model: int = 120, noise_ms: float = 0.1) -> list[dict]:
    rng = random.Random(seed)
    samples = []
    for (kernel, phase), (intercept, coefs) in TRUTH.items():
        for _ in range(per_model):
            batch = rng.choice((4, 8, 16, 32)) if phase == "decode" else rng.randint(1, 6)
            ranks = [rng.choice(RANKS) for _ in range(batch)]
            tokens = [rng.randint(8, 512) for _ in range(batch)]
            s = BatchShape.of(ranks, tokens)
            features = {
                ("bgmv", "decode"): (s.num * s.max_rank,),
                ("mbgmv", "decode"): (s.sum_rank,),
                ("bgmv", "prefill"): (s.sum_tokens, s.sum_tokens * s.max_rank),
                ("mbgmv", "prefill"): (s.sum_tokens, s.sum_token_rank),
            }[(kernel, phase)]
            latency = intercept + sum(c * f for c, f in zip(coefs, features))
            samples.append(
                {
                    "kernel": kernel,
                    "phase": phase,
                    "ranks": ranks,
                    "prompt_tokens": tokens,
                    "latency_ms": latency + rng.gauss(0.0, noise_ms),
                }
            )
    return samples


def test_fit_recovers_known_coefficients_and_reports_holdout_r2():
    models = fit_from_samples(synthetic_samples(seed=1))
    for (kernel, phase), (intercept, coefs) in TRUTH.items():
        model = models.models[f"{kernel}_{phase}"]
        assert model.intercept == pytest.approx(intercept, abs=0.5)
        assert model.coefficients == pytest.approx(coefs, rel=0.05)
        assert model.num_test == 24 and model.num_train == 96
        assert 0.9 < model.r2 <= 1.0


def test_r2_falls_when_the_model_misses_the_data():
    """Latency that depends on the rank mix only through noise gives a poor held-out R^2."""
    rng = random.Random(2)
    samples = [
        {
            "kernel": "mbgmv",
            "phase": "decode",
            "ranks": [rng.choice(RANKS) for _ in range(8)],
            "latency_ms": 30.0 + rng.gauss(0.0, 2.0),
        }
        for _ in range(60)
    ]
    model = fit_from_samples(samples).decode("mbgmv")
    assert model.r2 < 0.5
    with pytest.raises(KeyError, match="bgmv"):
        fit_from_samples(samples).decode("bgmv")


def test_save_load_round_trip(tmp_path):
    models = fit_from_samples(synthetic_samples(seed=3, per_model=40))
    path = tmp_path / "perf.json"
    models.save(path)
    loaded = PerfModels.load(path)
    shape = BatchShape.of([8, 64, 32], [100, 7, 300])
    for key, model in models.models.items():
        assert loaded.models[key].predict(shape) == pytest.approx(model.predict(shape))
        assert loaded.models[key].r2 == pytest.approx(model.r2)
    assert loaded.source == "fitted"


def test_empty_batch_costs_nothing_and_bad_samples_are_refused():
    models = fit_from_samples(synthetic_samples(seed=4, per_model=30))
    assert models.decode("bgmv").predict(BatchShape()) == 0.0
    with pytest.raises(ValueError):
        sample_shape({"ranks": [8, 8], "prompt_tokens": [3]})
    with pytest.raises(ValueError, match="too few"):
        fit_from_samples(synthetic_samples(seed=5, per_model=3))
    with pytest.raises(ValueError, match="unknown"):
        fit_from_samples([{"kernel": "sgmv", "phase": "decode", "ranks": [8], "latency_ms": 1}])
