"""Fit the Eq. 2 perf models from measured engine iterations and report held-out R^2.

    python -m bench.fit_perf_model SAMPLES.jsonl --out perf_model.json \
        [--report bench/results/perf_model.json] [--device "..."]

SAMPLES.jsonl holds one measured iteration per line, in the format of scheduler/perf_model.py:
{"kernel", "phase", "ranks": [...], "prompt_tokens": [...], "latency_ms"}. The model JSON is
what `toppings-scheduler --perf-model` reads; the report follows the bench/results format.
"""

from __future__ import annotations

import argparse
import json
import timeit
from pathlib import Path

from bench.envelope import write_result
from toppings.scheduler.perf_model import PerfModels, fit_from_samples
from toppings.scheduler.state import BatchShape


def read_samples(path: Path) -> list[dict]:
    samples = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                samples.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise SystemExit(f"{path}:{line_no}: not JSON: {exc}") from None
    return samples


def predict_us(models: PerfModels) -> float:
    """Mean time of one predict call on a 32-request batch, in microseconds."""
    shape = BatchShape.of([8, 16, 32, 64] * 8, [128] * 32)
    model = next(iter(models.models.values()))
    number = 100_000
    return timeit.timeit(lambda: model.predict(shape), number=number) / number * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("samples", type=Path, help="JSONL of measured iterations")
    parser.add_argument("--out", type=Path, required=True, help="perf-model JSON to write")
    parser.add_argument("--report", type=Path, help="bench/results/perf_model.json to write")
    parser.add_argument("--device", default="unknown", help="what the samples were measured on")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/held-out split")
    args = parser.parse_args(argv)

    samples = read_samples(args.samples)
    models = fit_from_samples(samples, seed=args.seed)
    models.save(args.out)
    cost_us = predict_us(models)
    for key, model in sorted(models.models.items()):
        terms = " + ".join(f"{c:.6g}*{n}" for c, n in zip(model.coefficients, model.feature_names))
        r2 = "n/a" if model.r2 is None else f"{model.r2:.3f}"
        print(f"{key:14s} R2(held-out)={r2}  n={model.num_train}+{model.num_test}  "
              f"latency_ms = {model.intercept:.4g} + {terms}")  # fmt: skip
    print(f"predict: {cost_us:.2f} us per call")
    if args.report:
        write_result(
            args.report,
            "perf_model",
            "fit_perf_model",
            device=args.device,
            argv=argv,
            config={"samples": str(args.samples), "num_samples": len(samples)},
            metrics={"r2": models.r2(), "predict_us": cost_us},
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
