"""bench_queueing's configurations (slora, chameleon-nocache, chameleon-nosched, chameleon) on a
simulated engine: the same traces, the real Scheduler, admission gate and queue policies, the
adapter cache's rules over an emulated link (bench/sim_adapters.py), and step times from the
engine's linear step-time model fitted on SmolLM2 (`--measure-steps`; no model runs during the
simulation). Seconds per sweep instead of the real benchmark's hour, so the configurations are
compared over ~10x more requests than a real run affords (a P99 of thousands of requests per
point); its figures are labelled "simulated", and bench_queueing's real runs validate it.

The run follows bench_queueing's: the SLO is 5x the mean E2E of `--alone` requests served alone
(adapters resident), each configuration's capacity the rate at which it completes a burst while
saturated, and the loads fractions of the baseline's (chameleon-nosched) capacity. With chunked
prefill on (the default) a step is mixed: d decodes and c prompt tokens cost the modelled decode
step of d plus c prompt tokens (StepModel.mixed_s, the engine's StepTimeModel), within the step
budget the engine itself chooses (server/sched/step_budget.py, from its default model).
`first-fit` is a reference order (every request that fits starts; nothing blocks, nothing
bounds a wait) with chameleon-nosched's cache, not a policy the server offers.

`--validate REAL.json` runs the sim with a real bench_queueing result's trace settings, SLO,
link, adapter budget and loads, on the very traces the real run replayed (its burst, its
rounds x duration at each load: a bursty 40 s round then weighs in both alike), and compares
each configuration's burst capacity and sustained load with the measured ones (the issue's
rule: within 10%), on the step model the real run's baseline engine ended with (corrected by
its own steps: server/sched/step_refit.py; recorded as `step_models` in the real result)
unless `--steps` or `--measure-steps` (on the real run's machine) give one.

    python -m bench.queueing_sim --measure-steps float32 --rounds 4 --duration 600
    python -m bench.queueing_sim --validate bench/results/queueing.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

from bench.bench_queueing import LINK_PROMPT_TOKENS, RANKS, add_arguments, plot, trace_for
from bench.common import link_gbps_for
from bench.envelope import describe_device, write_result
from bench.queueing_configs import (
    CONFIGS,
    FCFS,
    Comparison,
    burst_capacity,
    cache_budget,
    headlines,
    p99_of,
    parse_configs,
    sustained,
    sweep_fractions,
)
from bench.sim_engine import SimCache, SimLimits, Stalled, StepModel, measure_steps, run
from toppings.scripts.loadgen.stats import percentile
from toppings.server.config import PCIE4_X16_LATENCY_US, SchedulingConfig
from toppings.server.lora_modes import LORA_MODES
from toppings.server.sched.policies import QUEUE_POLICY_CLASSES
from toppings.server.sched.queueing import FcfsQueue, Verdict
from toppings.server.sched.step_budget import StepTimeModel, choose_step_budget

log = logging.getLogger("queueing_sim")
# SmolLM2-135M in float32: 30 layers; an adapter on q, k, v takes (576 + 576) + 2 x (576 + 192)
# numbers per rank and layer; a KV slot 2 x 3 heads x 64 per layer.
SMOLLM2_LAYERS = 30
SMOLLM2_ADAPTER_BYTES_PER_RANK = SMOLLM2_LAYERS * (2 * 576 + 2 * (576 + 192)) * 4
SMOLLM2_SLOT_BYTES = SMOLLM2_LAYERS * 2 * 3 * 64 * 4
VALIDATE_WITHIN = 0.10  # the rule: simulated vs measured capacity within 10%


class FirstFit(FcfsQueue):
    """Reference order, not a shipped policy: arrival order, every request that fits starts
    (no request blocks the ones behind it, and nothing bounds how long a large one waits)."""

    name = "first-fit"

    def select(self, gate, running, now):
        admitted = []
        for seq in list(self._waiting):
            verdict = gate.try_admit(seq)
            if verdict is Verdict.BATCH_FULL:
                break
            if verdict is Verdict.ADMITTED:
                self._waiting.remove(seq)
                admitted.append(seq)
        return admitted


POLICIES = {**QUEUE_POLICY_CLASSES, FirstFit.name: FirstFit}
SIM_CONFIGS = {**CONFIGS, "first-fit": Comparison("first-fit", "on-demand", True, "chameleon")}


def summarise(runs: list[list], slo_ms: float, num_stalled: int = 0) -> dict:
    """TTFT percentiles (ms), SLO attainment and throughput of simulated runs (lists of SimSeq,
    each from time 0), pooled. A request a stalled run never served counts as an infinite TTFT:
    a percentile it reaches is None, as is the mean."""
    seqs = [s for run in runs for s in run]
    ttft = [math.inf if s.first_token_s is None else 1000 * (s.first_token_s - s.arrival)
            for s in seqs]  # fmt: skip
    done = [s for s in seqs if s.finish_s is not None]
    span = sum(max((s.finish_s for s in run if s.finish_s is not None), default=0.0)
               for run in runs)  # fmt: skip

    def finite(value: float) -> float | None:
        return value if math.isfinite(value) else None

    return {
        "num_requests": len(ttft),
        "num_unserved": sum(s.first_token_s is None for s in seqs),
        "num_stalled_runs": num_stalled,
        "ttft_p50_ms": finite(_percentile(ttft, 50)),
        "ttft_p99_ms": finite(_percentile(ttft, 99)),
        "ttft_p999_ms": finite(_percentile(ttft, 99.9)),
        "ttft_max_ms": finite(max(ttft)),
        "ttft_mean_ms": finite(statistics.fmean(ttft)),
        "slo_attainment": sum(t <= slo_ms for t in ttft) / len(ttft),
        "throughput_rps": len(done) / span if span else 0.0,
    }


def _percentile(values: list[float], q: float) -> float:
    """percentile() where infinite values may be among them (inf - inf would give nan)."""
    value = percentile(values, q)
    return math.inf if math.isnan(value) else value


class Sim:
    """One simulated setup: the step model, the adapters, the shared limits and the cache."""

    def __init__(self, args, steps: StepModel, link_gbps: float, cache_bytes: int):
        self.args, self.steps = args, steps
        self.ranks = {f"r{r}-{i}": r for r in RANKS for i in range(args.per_rank)}
        self.link_gbps, self.cache_bytes = link_gbps, cache_bytes
        self.budget = None
        if args.chunked_prefill:  # the budget the engine chooses from its measured step model
            self.budget = choose_step_budget(args.max_batch_size, args.max_prefill_tokens,
                                             args.max_num_batched_tokens, model=steps)  # fmt: skip

    def limits(self, name: str | None) -> SimLimits:
        """The engine of configuration `name` (None: every adapter resident, no loads)."""
        a = self.args
        cache = None
        if name is not None:
            row = SIM_CONFIGS[name]
            latency_s = SMOLLM2_LAYERS * a.link_latency_us / 1e6  # one copy per layer
            cache = SimCache(self.cache_bytes, a.adapter_bytes_per_rank, a.slot_bytes,
                             self.link_gbps, latency_s, row.eviction, row.adapter_cache,
                             LORA_MODES[row.lora_mode].stall_for_load)  # fmt: skip
        return SimLimits(a.max_total_tokens, a.max_batch_size, a.max_prefill_tokens, self.ranks,
                         budget=self.budget, cache=cache)  # fmt: skip

    def policy(self, name: str | None, slo_ms: float):
        row = SIM_CONFIGS[name] if name else CONFIGS[FCFS]
        config = SchedulingConfig(ttft_slo_ms=slo_ms, max_batch_size=self.args.max_batch_size,
                                  fair_share=row.fair_share)  # fmt: skip
        return POLICIES[row.queue_policy](config, self.args.max_total_tokens)

    def run(self, name: str | None, trace, slo_ms: float) -> list:
        return run(self.policy(name, slo_ms), self.limits(name), trace, self.steps)

    def slo_ms(self) -> float:
        """5x the mean E2E of the alone requests, each served alone, its adapter resident."""
        alone = trace_for(self.args, self.ranks, 1.0, 999, None, self.args.alone)
        e2e = [self.run(None, [e], 5000.0)[0].finish_s for e in _at_zero(alone)]
        return 5000 * statistics.fmean(e2e)

    def capacity(self, name: str, slo_ms: float, bursts: int | None = None) -> float:
        """bench_queueing's burst capacity, averaged over `bursts` bursts (default `--rounds`;
        the first is bench_queueing's own)."""
        values = []
        for rnd in range(bursts or self.args.rounds):
            burst = _at_zero(trace_for(self.args, self.ranks, 1.0, 998 + rnd, None,
                                       self.args.burst))  # fmt: skip
            values.append(burst_capacity([s.finish_s for s in self.run(name, burst, slo_ms)]))
        return statistics.fmean(values)

    def sweep(self, names: list[str], loads: list[float], slo_ms: float) -> dict[str, list]:
        """Per configuration, per load: the summary pooled over `--rounds` traces."""
        table: dict[str, list[dict]] = {n: [] for n in names}
        for i, rps in enumerate(loads):
            for name in names:
                runs, stalled = [], 0
                for rnd in range(self.args.rounds):
                    seed = rnd * 100 + i  # bench_queueing's traces, where the loads are its own
                    trace = trace_for(self.args, self.ranks, rps, seed, self.args.duration)
                    try:
                        runs.append(self.run(name, trace, slo_ms))
                    except Stalled as exc:
                        log.warning("%5.2f req/s %s round %d: %s", rps, name, rnd, exc)
                        runs.append(exc.seqs)
                        stalled += 1
                table[name].append(summarise(runs, slo_ms, stalled))
                row = table[name][-1]
                log.warning("%5.2f req/s %-18s P50 %s  P99 %s  max %s ms  attainment %.3f",
                            rps, name, row["ttft_p50_ms"], row["ttft_p99_ms"],
                            row["ttft_max_ms"], row["slo_attainment"])  # fmt: skip
        return table


def _at_zero(trace) -> list:
    """The trace's entries all arriving at once (a burst)."""
    return [SimpleNamespace(prompt=e.prompt, max_tokens=e.max_tokens, arrival_s=0.0,
                            model=e.model) for e in trace]  # fmt: skip


def compare(measured: dict[str, float], simulated: dict[str, float]) -> dict:
    """Per configuration both values, simulated / measured and whether they agree within
    VALIDATE_WITHIN; `all_within` over every configuration measured."""
    rows = {}
    for name, real in measured.items():
        if name in simulated and real:
            ratio = simulated[name] / real
            rows[name] = {"measured": real, "simulated": simulated[name], "ratio": ratio,
                          "within": abs(ratio - 1) <= VALIDATE_WITHIN}  # fmt: skip
    return {"per_config": rows, "all_within": all(r["within"] for r in rows.values()),
            "tolerance": VALIDATE_WITHIN}  # fmt: skip


SWEEP_PLOT = Path("bench/queueing_sim_ttft.png")
VALIDATE_PLOT = Path("bench/queueing_validate_ttft.png")


def real_steps(real_path: Path) -> dict[str, StepModel]:
    """The step model each configuration's engine of a real bench_queueing run ended with
    (corrected by its own steps: server.sched.step_refit), by name; {} for a result without
    them."""
    m = json.loads(real_path.read_text())["metrics"]
    return {n: StepModel.of_engine(StepTimeModel(**f), f"the real run's {n} engine")
            for n, f in m.get("step_models", {}).items() if f}  # fmt: skip


def validate(
    args, steps: StepModel, real_path: Path, own_steps: dict[str, StepModel] | None = None
) -> dict:
    """The sim at a real bench_queueing run's SLO, link, adapter budget and loads, against its
    measured capacities and sustained loads; each configuration on its own engine's step model
    where `own_steps` has it (as each real engine ran on its own refit), else on `steps`."""
    real = json.loads(real_path.read_text())
    m, c = real["metrics"], real["config"]
    if c.get("memory_layout", "static") != "static":
        raise ValueError(f"{real_path}: the simulator models --memory-layout static only")
    for key in ("per_rank", "max_prompt_len", "output_len", "max_output_len",
                "max_total_tokens", "max_batch_size", "max_prefill_tokens",
                "max_num_batched_tokens", "chunked_prefill", "alone", "burst",
                "duration", "rounds"):  # fmt: skip
        setattr(args, key, c[key])
    args.adapter_bytes_per_rank = m["adapter_bytes_per_rank"]
    budgets = {b for b in m.get("step_budget_tokens", {}).values() if b}
    if len(budgets) == 1 and "step_models" not in m and not args.max_num_batched_tokens:
        # the real engines' shared budget (a run with step models: the budget is the model's)
        args.max_num_batched_tokens = budgets.pop()
    names = list(m["per_load"])
    models = {n: (own_steps or {}).get(n, steps) for n in names}
    sims = {n: Sim(args, models[n], m["link_gbps"], m["adapter_cache_bytes"]) for n in names}
    capacity = {n: sims[n].capacity(n, m["slo_ms"], bursts=1) for n in names}
    table = {n: sims[n].sweep([n], m["loads_rps"], m["slo_ms"])[n] for n in names}
    held = {n: sustained(m["loads_rps"], p99_of(rows), m["slo_ms"])[0]
            for n, rows in table.items()}  # fmt: skip
    return {
        "real": str(real_path),
        "capacity_rps": compare(m["capacity_rps"], capacity),
        "sustained_rps": compare(m["sustained_rps"], held),
        "slo_ms": {
            "measured": m["slo_ms"],
            "simulated": Sim(args, steps, m["link_gbps"], m["adapter_cache_bytes"]).slo_ms(),
        },
        "step_models": {n: asdict(model) for n, model in models.items()},
        "loads_rps": m["loads_rps"],
        "per_load": table,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("--loads", default="0.25,0.375,0.5,0.625,0.75,0.875,1.0,1.125,1.25,1.5",
                   help="fractions of the baseline's capacity (1.25 always added)")  # fmt: skip
    p.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals a round")
    p.add_argument("--rounds", type=int, default=3, help="traces per load (seeds)")
    p.add_argument("--alone", type=int, default=8, help="requests served alone for the SLO")
    p.add_argument("--burst", type=int, default=32, help="requests of a capacity burst")
    p.add_argument("--slo-ms", type=float, default=0.0, help="0: bench_queueing's rule")
    p.add_argument("--link-latency-us", type=float, default=PCIE4_X16_LATENCY_US)
    p.add_argument("--adapter-bytes-per-rank", type=int, default=SMOLLM2_ADAPTER_BYTES_PER_RANK)
    p.add_argument("--slot-bytes", type=int, default=SMOLLM2_SLOT_BYTES)
    p.add_argument("--steps", default="{}", help="StepModel fields as JSON")
    p.add_argument("--measure-steps", metavar="DTYPE",
                   help="fit the step model on the real engine first (~1 min)")  # fmt: skip
    p.add_argument("--validate", type=Path, metavar="REAL_JSON",
                   help="compare with a real bench_queueing result, no sweep")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench/results/queueing_sim.json"))
    p.add_argument("--plot", type=Path, default=None,
                   help="default: bench/queueing_sim_ttft.png (--validate: the real points "
                        "beside the simulated ones, bench/queueing_validate_ttft.png)")  # fmt: skip
    p.add_argument("--real", type=Path, help="a bench_queueing result to draw beside")
    args = p.parse_args(argv)
    args.chunked_prefill = args.chunked_prefill == "on"
    if args.memory_layout != "static":
        p.error("the simulator models --memory-layout static only")
    logging.basicConfig(level=logging.WARNING)
    steps = StepModel(**json.loads(args.steps))
    if args.measure_steps:
        steps, points = measure_steps(args.measure_steps)
        log.warning("measured on %s: %s -> %s", describe_device(), points, steps)
    own_steps = {}
    if args.validate and args.steps == "{}" and not args.measure_steps:
        own_steps = real_steps(args.validate)
        steps = own_steps.get(FCFS) or next(iter(own_steps.values()), steps)
    if args.validate:
        result = validate(args, steps, args.validate, own_steps)
        _write(args, argv, steps, result)
        real = json.loads(args.validate.read_text())["metrics"]
        series = [("real", real["loads_rps"], real["per_load"], False),
                  ("simulated", result["loads_rps"], result["per_load"], True)]  # fmt: skip
        plot(args.plot or VALIDATE_PLOT, series, real["slo_ms"],
             f"real vs simulated on the real run's traces ({args.rounds} rounds x "
             f"{args.duration:.0f} s per point), each on its engine's step model")  # fmt: skip
        log.warning("capacity %s; sustained %s", result["capacity_rps"],
                    result["sustained_rps"])  # fmt: skip
        return
    names = parse_configs(args.configs, SIM_CONFIGS)
    nbytes = {r: r * args.adapter_bytes_per_rank for r in RANKS}
    cache_bytes = cache_budget(nbytes, args.per_rank, args.cache_share)
    link_gbps = args.link_gbps or link_gbps_for(nbytes[64], steps.prefill_s(LINK_PROMPT_TOKENS))
    sim = Sim(args, steps, link_gbps, cache_bytes)
    slo_ms = args.slo_ms or sim.slo_ms()
    base = FCFS if FCFS in names else names[0]
    capacity = {n: sim.capacity(n, slo_ms) for n in names}
    fractions, overload_idx = sweep_fractions(args.loads)
    loads = [f * capacity[base] for f in fractions]
    table = sim.sweep(names, loads, slo_ms)
    p99 = {n: p99_of(rows) for n, rows in table.items()}
    metrics = {
        **headlines(loads, p99, slo_ms, overload_idx),
        "slo_ms": slo_ms,
        "capacity_rps": capacity,
        "loads_rps": loads,
        "load_fractions_of_baseline_capacity": fractions,
        "link_gbps": link_gbps,
        "adapter_cache_bytes": cache_bytes,
        "adapter_bytes_per_rank": args.adapter_bytes_per_rank,
        "step_budget": asdict(sim.budget) if sim.budget else None,
        "per_load": table,
    }
    _write(args, argv, steps, metrics)
    series = [("simulated", loads, table, True)]
    if args.real is not None and args.real.is_file():
        real = json.loads(args.real.read_text())["metrics"]
        if "adapter_cache_bytes" in real:  # a result of these configurations
            series.append(("real", real["loads_rps"], real["per_load"], False))
    plot(args.plot or SWEEP_PLOT, series, slo_ms, f"simulated: SmolLM2 step model, "
         f"{args.rounds} rounds x {args.duration:.0f} s per point, chunked prefill "
         f"{'on' if args.chunked_prefill else 'off'}")  # fmt: skip
    log.warning("%s", {k: v for k, v in metrics.items() if k not in ("per_load", "loads_rps")})


def _write(args, argv, steps: StepModel, metrics: dict) -> None:
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    config["step_model"] = asdict(steps)
    config["configs"] = {n: asdict(r) for n, r in SIM_CONFIGS.items()}
    write_result(args.out, "queueing_sim", "queueing_sim", device="simulated (no model runs)",
                 argv=argv, config=config, metrics=metrics)  # fmt: skip


if __name__ == "__main__":
    main()
