"""Measure real engine iterations on this machine and fit the scheduler's perf models from them.

    python -m bench.profile_perf_model [--model smollm2] [--dtype bfloat16] [--threads N] \
        [--kernels bgmv,mbgmv] [--batch-sizes 1,2,4,8,12,16,24,32] [--passes 3] \
        [--refit SAMPLES.jsonl]

Each measured "run" submits B requests at once, with adapters of the chosen ranks (one distinct
adapter per request, as in a trace of many adapters) and prompts of the chosen lengths, so that
the engine admits them in one prefill step and then runs `--decode-steps` decode steps on exactly
that batch. A measurement of a run is its prefill step's time and the median of its single decode
step times, read from `engine.step_stats` between the tokens of request 0. Every run is measured
in `--passes` passes and keeps its fastest measurement (see `_samples`); runs that sit well above
a first fit are measured twice more. A run is one sample per phase, so the fitting code's seeded
80/20 split holds out whole batches.

Writes bench/results/perf_model_samples_<tag>.jsonl, the perf-model JSON the scheduler loads
(bench/results/perf_model_<tag>.json, the best-fitting form; perf_model_<tag>_eq2.json keeps
Toppings Eq. 2), and bench/results/perf_model.json (r2 of both forms, predict_us).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench.envelope import describe_device, write_result
from bench.fit_perf_model import predict_us, read_samples
from toppings.scheduler.perf_model import (
    FEATURES,
    FORMS,
    PerfModels,
    fit_from_samples,
    sample_shape,
)
from toppings.scripts.make_adapters import load_base, make_random_adapter
from toppings.server.config import EngineConfig
from toppings.server.model.loader import resolve_model_dir
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.runtime import build_engine

log = logging.getLogger("profile_perf_model")
RANKS = (8, 16, 32, 64)
TARGETS = ("q_proj", "k_proj", "v_proj")
MIN_PROMPT, MAX_PROMPT = 16, 256
OUTLIER_Z = 2.0  # robust z-score above a first fit that gets a run measured again
NUM_REPEATS = 2  # extra measurements of such a run
SPLIT_SEEDS = range(20)  # more held-out splits, to show how much R^2 depends on the split


@dataclass(frozen=True)
class Run:
    """One batch to measure: a rank and a prompt length per request."""

    batch_id: int
    mix: str
    ranks: tuple[int, ...]
    prompt_lens: tuple[int, ...]


def plan_runs(batch_sizes: list[int], ranks: tuple[int, ...], max_tokens: int, seed: int) -> list:
    """One run per (batch size, rank mix), prompt lengths drawn per run.

    Mixes: all requests of one rank (each rank), and for B > 1 uniform random ranks and a skewed
    batch (a quarter at the largest rank, the rest at the smallest: BGMV's padding worst case).
    Prompt lengths are uniform in [MIN_PROMPT, min(MAX_PROMPT, max_tokens / B)].
    """
    rng = random.Random(seed)
    runs = []
    for batch in batch_sizes:
        mixes = {f"all-{r}": [r] * batch for r in ranks}
        if batch > 1:
            mixes["uniform"] = [rng.choice(ranks) for _ in range(batch)]
            num_high = max(1, batch // 4)
            mixes["skewed"] = [ranks[-1]] * num_high + [ranks[0]] * (batch - num_high)
        longest = max(MIN_PROMPT, min(MAX_PROMPT, max_tokens // batch))
        for mix, mix_ranks in mixes.items():
            lens = tuple(rng.randint(MIN_PROMPT, longest) for _ in range(batch))
            runs.append(Run(len(runs), mix, tuple(mix_ranks), lens))
    return runs


def make_rank_adapters(model_dir: Path, root: Path, ranks: tuple[int, ...]) -> dict[int, str]:
    """One random PEFT adapter per rank under `root`, made once and reused."""
    paths, base = {}, None
    for rank in ranks:
        path = root / f"r{rank}"
        if not (path / "adapter_config.json").is_file():
            base = base or load_base(model_dir)
            make_random_adapter(path, base, rank=rank, target_modules=TARGETS, seed=rank)
        paths[rank] = str(path)
    return paths


class BatchTimer:
    """Times one batch of requests on a running engine, from its step counters."""

    def __init__(self, engine, decode_steps: int, seed: int):
        self.engine = engine
        self.decode_steps = decode_steps
        self.rng = random.Random(seed)
        self.vocab = engine.model_config.vocab_size
        self.names: dict[int, list[str]] = {}
        for card in engine.adapters():
            self.names.setdefault(card["rank"], []).append(card["name"])

    def measure(self, run: Run, attempts: int = 3) -> tuple[float, float, list[float]]:
        """(prefill ms, median decode step ms, single decode step ms) of `run`."""
        for _ in range(attempts):
            timed = self._once(run)
            if timed is not None:
                return timed
        raise RuntimeError(f"run {run.batch_id}: the engine never took the batch in one prefill")

    def _once(self, run: Run) -> tuple[float, float, list[float]] | None:
        engine, st = self.engine, self.engine.step_stats
        names = []
        for rank in sorted(set(run.ranks)):  # a distinct adapter per request, as in a big trace
            picked = iter(self.rng.sample(self.names[rank], run.ranks.count(rank)))
            names += [(i, next(picked)) for i, r in enumerate(run.ranks) if r == rank]
        names = [n for _, n in sorted(names)]
        prompts = [[self.rng.randrange(100, self.vocab) for _ in range(n)] for n in run.prompt_lens]
        params = SamplingParams(self.decode_steps + 1, temperature=0.0, ignore_eos=True)
        prefill0, prefill_s0, decode0 = st.prefill_steps, st.prefill_s, st.decode_steps
        requests = [
            GenerationRequest(p, params, engine.resolve_adapter(n)) for p, n in zip(prompts, names)
        ]
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1.0)  # keep the GIL until all B are queued: one prefill step
        try:
            handles = [engine.submit(r) for r in requests]
        finally:
            sys.setswitchinterval(interval)
        # A token of request 0 arrives after its step ran and before the next one is counted:
        # counter snapshots one decode step apart time exactly that step.
        marks = [(st.decode_steps, st.decode_s) for _ in handles[0].events()]
        for handle in handles[1:]:
            handle.result()
        deadline = time.monotonic() + 30.0
        while st.decode_steps - decode0 < self.decode_steps and time.monotonic() < deadline:
            time.sleep(0.001)
        marks.append((st.decode_steps, st.decode_s))
        if st.prefill_steps - prefill0 != 1 or st.decode_steps - decode0 != self.decode_steps:
            log.warning("run %d: %d prefill and %d decode steps; measuring again", run.batch_id,
                        st.prefill_steps - prefill0, st.decode_steps - decode0)  # fmt: skip
            return None
        steps = [1e3 * (s1 - s0) for (n0, s0), (n1, s1) in zip(marks, marks[1:]) if n1 - n0 == 1]
        if len(steps) < max(1, self.decode_steps // 2):  # too few single steps seen: the mean
            steps = [1e3 * (marks[-1][1] - marks[0][1]) / max(1, marks[-1][0] - marks[0][0])]
        return 1e3 * (st.prefill_s - prefill_s0), statistics.median(steps), steps


def slow_outliers(samples: list[dict], form: str) -> list[int]:
    """Indices of samples above an all-samples fit by more than OUTLIER_Z robust sigmas.

    Only above: other jobs can slow a step down, never speed it up.
    """
    names = FORMS[form][(samples[0]["kernel"], samples[0]["phase"])]
    shapes = [sample_shape(s) for s in samples]
    x = np.array([[1.0] + [FEATURES[n](s) for n in names] for s in shapes])  # [n, P]
    y = np.array([s["latency_ms"] for s in samples])  # [n]
    beta, *_ = np.linalg.lstsq(x, y, rcond=None)
    residual = y - x @ beta
    scale = 1.4826 * float(np.median(np.abs(residual - np.median(residual)))) or 1e-9
    z = residual / scale
    return [int(i) for i in np.argsort(-z) if z[i] > OUTLIER_Z]


def measure_kernel(args: argparse.Namespace, kernel: str, runs: list[Run]) -> tuple[list, dict]:
    """Decode and prefill samples of `runs` on a fresh engine using `kernel`.

    Every run is measured once per pass (a new random order each pass), so that its measurements
    fall at different times; runs well above a first fit get NUM_REPEATS more.
    """
    model_dir = resolve_model_dir(args.model)
    ranks = sorted({r for run in runs for r in run.ranks})
    paths = make_rank_adapters(model_dir, Path(args.adapter_dir), tuple(ranks))
    max_batch = max(len(r.ranks) for r in runs)
    # The same files under many names: every name gets its own rows in the adapter pool, which
    # is all that timing depends on. More names than a batch holds, so that a batch's adapters
    # are scattered over the pool as in a server (contiguous rows would be read without a copy).
    loras = {f"r{r}-{i}": paths[r] for r in ranks for i in range(max_batch * 3 // 2)}
    need = max(sum(r.prompt_lens) + len(r.ranks) * (args.decode_steps + 1) for r in runs)
    config = EngineConfig(device=args.device, dtype=args.dtype, kernel=kernel,
                          max_batch_size=max_batch, max_total_tokens=need,
                          max_prefill_tokens=need)  # fmt: skip
    engine = build_engine(str(model_dir), config, loras)
    started = time.perf_counter()
    rng = random.Random(zlib.crc32(kernel.encode()) + args.seed)
    by_id = {run.batch_id: run for run in runs}
    measured: dict[int, list] = {run.batch_id: [] for run in runs}
    repeat: set[int] = set()
    try:
        timer = BatchTimer(engine, args.decode_steps, seed=rng.randrange(1 << 30))
        for run in sorted(runs, key=lambda r: -len(r.ranks))[:2]:  # warm-up, not recorded
            timer.measure(run)
        for _ in range(args.passes):
            for run in rng.sample(runs, len(runs)):
                measured[run.batch_id].append(timer.measure(run))
        first = _samples(kernel, by_id, measured)
        for phase in ("decode", "prefill"):
            phase_samples = [s for s in first if s["phase"] == phase]
            for idx in slow_outliers(phase_samples, "batch"):
                if len(repeat) < args.max_repeat_fraction * len(runs):
                    repeat.add(phase_samples[idx]["batch_id"])
        for batch_id in sorted(repeat):
            measured[batch_id] += [timer.measure(by_id[batch_id]) for _ in range(NUM_REPEATS)]
    finally:
        engine.shutdown()
    stats = {"num_runs": len(runs), "passes": args.passes, "num_repeated": len(repeat),
             "seconds": time.perf_counter() - started}  # fmt: skip
    log.info("%s: %s", kernel, stats)
    return _samples(kernel, by_id, measured), stats


def _samples(kernel: str, runs: dict[int, Run], measured: dict[int, list]) -> list[dict]:
    """One decode and one prefill sample per run.

    latency_ms is the fastest of the run's measurements (each a single prefill step, or the
    median decode step of a run): other jobs on the machine only ever slow a step down, so the
    fastest is the engine's own cost. median_ms (of the measurements) is kept for comparison.
    """
    out = []
    for batch_id, times in sorted(measured.items()):
        run = runs[batch_id]
        common = {"kernel": kernel, "ranks": list(run.ranks), "mix": run.mix,
                  "prompt_tokens": list(run.prompt_lens), "batch_id": batch_id}  # fmt: skip
        for phase, idx in (("prefill", 0), ("decode", 1)):
            values = [t[idx] for t in times]
            sample = {**common, "phase": phase, "latency_ms": min(values),
                      "median_ms": statistics.median(values),
                      "measurements_ms": values}  # fmt: skip
            if phase == "decode":
                sample["step_ms"] = [s for t in times for s in t[2]]
            out.append(sample)
    return out


def fit_forms(samples: list[dict], seed: int = 0) -> dict[str, PerfModels]:
    return {form: fit_from_samples(samples, seed=seed, form=form) for form in FORMS}


def split_spread(samples: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """Held-out R^2 of every form and model over SPLIT_SEEDS: min, median, max."""
    r2s: dict[str, dict[str, list[float]]] = {}
    for seed in SPLIT_SEEDS:
        for form, models in fit_forms(samples, seed).items():
            for key, r2 in models.r2().items():
                r2s.setdefault(form, {}).setdefault(key, []).append(r2)
    return {
        form: {k: {"min": min(v), "median": statistics.median(v), "max": max(v)}
               for k, v in sorted(keys.items())}
        for form, keys in r2s.items()
    }  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0: torch's default). On a small machine shared"
                   " with other jobs, threads that wait on each other at every op make step times"
                   " vary 3x; 1 is steady")  # fmt: skip
    p.add_argument("--kernels", default="bgmv,mbgmv")
    p.add_argument("--batch-sizes", default="1,2,4,8,12,16,24,32")
    p.add_argument("--ranks", default=",".join(map(str, RANKS)))
    p.add_argument("--passes", type=int, default=3, help="measurements of every run")
    p.add_argument("--decode-steps", type=int, default=4, help="decode steps timed per run")
    p.add_argument("--max-prefill-tokens", type=int, default=384, help="prompt tokens per run")
    p.add_argument("--max-repeat-fraction", type=float, default=0.3,
                   help="at most this share of the runs is measured again")  # fmt: skip
    p.add_argument("--adapter-dir", default="/tmp/toppings-perf-adapters")
    p.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    p.add_argument("--refit", type=Path, help="fit a samples JSONL again, measure nothing")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("toppings.server", "toppings.gpu_lora", "toppings.scripts.make_adapters"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    tag = f"{Path(args.model).name}_{args.device}"
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    samples_path = args.refit or out_dir / f"perf_model_samples_{tag}.jsonl"
    started = time.perf_counter()
    config: dict = {"model": args.model, "dtype": args.dtype, "device": args.device,
                    "torch_threads": torch.get_num_threads()}  # fmt: skip
    if args.refit:
        samples = read_samples(args.refit)
    else:
        ranks = tuple(int(r) for r in args.ranks.split(","))
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        runs = plan_runs(batch_sizes, ranks, args.max_prefill_tokens, args.seed)
        samples, stats = [], {}
        for kernel in args.kernels.split(","):
            kernel_samples, stats[kernel] = measure_kernel(args, kernel, runs)
            samples += kernel_samples
        samples_path.write_text("".join(json.dumps(s) + "\n" for s in samples))
        config.update({
            "kernels": args.kernels.split(","), "batch_sizes": batch_sizes, "ranks": list(ranks),
            "runs_per_kernel": len(runs), "passes": args.passes,
            "decode_steps_per_run": args.decode_steps,
            "max_prefill_tokens_per_run": args.max_prefill_tokens, "measuring": stats,
        })  # fmt: skip
    config.update({
        "samples": str(samples_path), "num_samples": len(samples),
        "latency": "per run, the fastest of its measurements (passes, plus repeats); a"
        " measurement is the prefill step's wall time, or the median of its decode steps'",
        "split": "seeded 80/20 over samples; one sample per measured batch",
    })  # fmt: skip

    fitted = fit_forms(samples)
    for form, models in fitted.items():
        print(f"form {form} (held-out R^2, split seed 0):")
        for key, m in sorted(models.models.items()):
            terms = " + ".join(f"{c:.4g}*{n}" for c, n in zip(m.coefficients, m.feature_names))
            print(f"  {key:14s} R2={m.r2:.3f} n={m.num_train}+{m.num_test}: "
                  f"{m.intercept:.4g} + {terms}")  # fmt: skip
    best = max(fitted, key=lambda f: float(np.mean(list(fitted[f].r2().values()))))
    model_path = out_dir / f"perf_model_{tag}.json"
    fitted[best].save(model_path)
    fitted["eq2"].save(out_dir / f"perf_model_{tag}_eq2.json")
    median_samples = [{**s, "latency_ms": s.get("median_ms", s["latency_ms"])} for s in samples]
    cost_us = predict_us(fitted[best])
    forms = {f: {f"{k}_{p}": list(n) for (k, p), n in sorted(feats.items())}
             for f, feats in FORMS.items()}  # fmt: skip
    write_result(
        out_dir / "perf_model.json",
        "perf_model",
        "profile_perf_model",
        device=f"{describe_device(args.device)}, cores shared with other jobs",
        argv=argv,
        config={
            **config,
            "forms": forms,
            "scheduler_model": str(model_path),
            "scheduler_model_form": best,
        },
        metrics={
            "r2": fitted["eq2"].r2(),
            "r2_by_form": {f: m.r2() for f, m in fitted.items()},
            "r2_split_spread": split_spread(samples),
            "r2_by_form_median_of_measurements": {
                f: m.r2() for f, m in fit_forms(median_samples).items()
            },
            "predict_us": cost_us,
            "models": {
                f: {k: v.to_json() for k, v in sorted(m.models.items())} for f, m in fitted.items()
            },
            "wall_s": time.perf_counter() - started,
        },
    )
    print(f"predict: {cost_us:.2f} us; scheduler model ({best}): {model_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
