"""Latency models of one engine iteration per LoRA kernel (Toppings Eq. 2), fitted from samples.

Decode (one token for every request of batch S), exactly Eq. 2:
    PERF_BGMV(S)  = a_B * |S| * max rank + b_B      (BGMV pads every request to the max rank)
    PERF_MBGMV(S) = a_M * sum rank + b_M            (MBGMV computes each request at its rank)
Prefill grows with the prompt tokens too, so it gets one term in the total prompt tokens and one
in the LoRA work, tokens x rank (padded to the max rank for BGMV):
    PREFILL_BGMV(S)  = c0 + c1 * sum tokens + c2 * sum tokens * max rank
    PREFILL_MBGMV(S) = c0 + c1 * sum tokens + c2 * sum(tokens_i * rank_i)
An empty set costs 0: no iteration runs. Latencies are in milliseconds.

Eq. 2 assumes the base model's cost does not depend on the batch, as on a GPU that is far from
saturated. On a CPU it grows with |S| (lm_head, sampling, attention). FORMS["batch"] adds terms
in |S| and |S| x rank (fitted when the dense masked CPU decode path, since replaced by one
matmul pair per adapter run, made LoRA work grow with |S| x the Eq. 2 term); FORMS["eq2"] (the
default) is the paper's. A fitted model carries its feature names, so a JSON file says which
form it is.

Sample format (one JSON object per measured engine iteration; JSONL on disk):
    {"kernel": "bgmv"|"mbgmv", "phase": "decode"|"prefill",
     "ranks": [int, one per request, 0 for no adapter],
     "prompt_tokens": [int, one per request; prefill: tokens prefilled, decode: may be omitted],
     "latency_ms": float}
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from toppings.scheduler.state import BatchShape

KERNELS = ("bgmv", "mbgmv")
PHASES = ("decode", "prefill")
HOLDOUT_FRACTION = 0.2

FEATURES: dict[str, Callable[[BatchShape], float]] = {
    "num": lambda s: s.num,
    "num_x_max_rank": lambda s: s.num * s.max_rank,
    "num_sq_x_max_rank": lambda s: s.num * s.num * s.max_rank,
    "sum_rank": lambda s: s.sum_rank,
    "num_x_sum_rank": lambda s: s.num * s.sum_rank,
    "sum_tokens": lambda s: s.sum_tokens,
    "sum_tokens_x_max_rank": lambda s: s.sum_tokens * s.max_rank,
    "sum_token_rank": lambda s: s.sum_token_rank,
}
MODEL_FEATURES: dict[tuple[str, str], tuple[str, ...]] = {  # Toppings Eq. 2
    ("bgmv", "decode"): ("num_x_max_rank",),
    ("mbgmv", "decode"): ("sum_rank",),
    ("bgmv", "prefill"): ("sum_tokens", "sum_tokens_x_max_rank"),
    ("mbgmv", "prefill"): ("sum_tokens", "sum_token_rank"),
}
FORMS: dict[str, dict[tuple[str, str], tuple[str, ...]]] = {
    "eq2": MODEL_FEATURES,
    "batch": {
        ("bgmv", "decode"): ("num", "num_x_max_rank", "num_sq_x_max_rank"),
        ("mbgmv", "decode"): ("num", "sum_rank", "num_x_sum_rank"),
        ("bgmv", "prefill"): ("num", "sum_tokens", "sum_tokens_x_max_rank"),
        ("mbgmv", "prefill"): ("num", "sum_tokens", "sum_token_rank"),
    },
}


@dataclass(frozen=True)
class LinearPerfModel:
    """latency_ms = intercept + sum(coef_i * feature_i(S)); r2 is measured on held-out samples."""

    kernel: str
    phase: str
    intercept: float
    coefficients: tuple[float, ...]
    r2: float | None = None
    num_train: int = 0
    num_test: int = 0
    features: tuple[str, ...] = ()  # names in FEATURES; () means Eq. 2's
    _terms: tuple[tuple[Callable[[BatchShape], float], float], ...] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        names = self.features or MODEL_FEATURES[(self.kernel, self.phase)]
        unknown = [n for n in names if n not in FEATURES]
        if unknown:
            raise ValueError(f"{self.key}: unknown features {unknown}")
        object.__setattr__(self, "features", tuple(names))
        if len(self.coefficients) != len(names):
            raise ValueError(f"{self.key} needs {len(names)} coefficients for {names}")
        terms = tuple((FEATURES[n], float(c)) for n, c in zip(names, self.coefficients))
        object.__setattr__(self, "_terms", terms)

    @property
    def key(self) -> str:
        return f"{self.kernel}_{self.phase}"

    @property
    def feature_names(self) -> tuple[str, ...]:
        return self.features

    def predict(self, shape: BatchShape) -> float:
        """Predicted iteration latency in ms of the batch `shape`; plain float math."""
        if shape.num == 0:
            return 0.0
        total = self.intercept
        for feature, coef in self._terms:
            total += coef * feature(shape)
        return total

    def to_json(self) -> dict[str, Any]:
        return {
            "features": list(self.feature_names),
            "coefficients": list(self.coefficients),
            "intercept": self.intercept,
            "r2": self.r2,
            "num_train": self.num_train,
            "num_test": self.num_test,
        }


@dataclass(frozen=True)
class PerfModels:
    """Decode and prefill models keyed "<kernel>_<phase>", plus where the numbers come from.

    A profile may cover one kernel only; asking for a model it lacks raises KeyError.
    """

    models: Mapping[str, LinearPerfModel]
    source: str = "fitted"

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("no perf models")

    def decode(self, kernel: str) -> LinearPerfModel:
        return self._get(kernel, "decode")

    def prefill(self, kernel: str) -> LinearPerfModel:
        return self._get(kernel, "prefill")

    def _get(self, kernel: str, phase: str) -> LinearPerfModel:
        try:
            return self.models[f"{kernel}_{phase}"]
        except KeyError:
            raise KeyError(f"no {phase} perf model for kernel {kernel!r}") from None

    def r2(self) -> dict[str, float | None]:
        return {key: model.r2 for key, model in self.models.items()}

    def save(self, path: str | Path) -> None:
        body = {
            "version": 1,
            "unit": "ms",
            "source": self.source,
            "models": {k: m.to_json() for k, m in sorted(self.models.items())},
        }
        Path(path).write_text(json.dumps(body, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> PerfModels:
        body = json.loads(Path(path).read_text())
        if "metrics" in body and "version" not in body:  # a bench/results envelope
            raise ValueError(f"{path}: a benchmark result, not a perf-model file (one "
                             "bench/fit_perf_model.py writes, e.g. "
                             "bench/results/perf_model_smollm2_cpu.json)")  # fmt: skip
        if body.get("version") != 1:
            raise ValueError(f"{path}: unsupported perf-model version {body.get('version')!r}")
        models = {}
        for key, entry in body["models"].items():
            kernel, phase = key.split("_", 1)
            if (kernel, phase) not in MODEL_FEATURES:
                raise ValueError(f"{path}: unknown model {key!r}")
            unknown = [n for n in entry["features"] if n not in FEATURES]
            if unknown or not entry["features"]:
                raise ValueError(f"{path}: {key} features {entry['features']} are not ours")
            models[key] = LinearPerfModel(
                kernel,
                phase,
                float(entry["intercept"]),
                tuple(float(c) for c in entry["coefficients"]),
                entry.get("r2"),
                int(entry.get("num_train", 0)),
                int(entry.get("num_test", 0)),
                tuple(entry["features"]),
            )
        return cls(models, str(body.get("source", "fitted")))


def sample_shape(sample: Mapping[str, Any]) -> BatchShape:
    """Batch aggregates of one measured sample (see the module docstring for the format)."""
    ranks = [int(r) for r in sample["ranks"]]
    tokens = sample.get("prompt_tokens") or [0] * len(ranks)
    if len(tokens) != len(ranks) or not ranks:
        raise ValueError("a sample needs one prompt_tokens entry per rank and at least one request")
    return BatchShape.of(ranks, (int(t) for t in tokens))


def fit_model(
    kernel: str, phase: str, samples: list[Mapping[str, Any]], seed: int = 0, form: str = "eq2"
) -> LinearPerfModel:
    """Least-squares fit on a seeded 80% of `samples`, R^2 on the other 20%.

    Give one sample per measured batch, so that the split holds out whole batches.
    """
    names = FORMS[form][(kernel, phase)]
    num_params = len(names) + 1
    if len(samples) < 2 * num_params + 2:
        raise ValueError(f"{kernel}_{phase}: {len(samples)} samples are too few to fit and test")
    shapes = [sample_shape(s) for s in samples]
    x = np.array([[1.0] + [FEATURES[n](s) for n in names] for s in shapes])  # [n, P]
    y = np.array([float(s["latency_ms"]) for s in samples])  # [n]
    order = np.random.default_rng(seed).permutation(len(samples))
    num_test = max(2, int(round(HOLDOUT_FRACTION * len(samples))))
    test, train = order[:num_test], order[num_test:]
    beta, *_ = np.linalg.lstsq(x[train], y[train], rcond=None)
    residual = y[test] - x[test] @ beta
    total = y[test] - y[test].mean()
    ss_tot = float(total @ total)
    r2 = 1.0 - float(residual @ residual) / ss_tot if ss_tot > 0 else None
    coefficients = tuple(float(b) for b in beta[1:])
    return LinearPerfModel(
        kernel, phase, float(beta[0]), coefficients, r2, len(train), num_test, names
    )


def fit_from_samples(
    samples: Iterable[Mapping[str, Any]], seed: int = 0, form: str = "eq2"
) -> PerfModels:
    """Fit one model of `form` (see FORMS) per (kernel, phase) present in the iterations."""
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r}; choose from {', '.join(FORMS)}")
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for sample in samples:
        key = (sample["kernel"], sample["phase"])
        if key not in MODEL_FEATURES:
            raise ValueError(f"unknown kernel/phase {key}")
        groups.setdefault(key, []).append(sample)
    models = {
        f"{kernel}_{phase}": fit_model(kernel, phase, group, seed, form)
        for (kernel, phase), group in sorted(groups.items())
    }
    return PerfModels(models, source="fitted")
