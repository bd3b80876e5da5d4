"""The queue policies (`--queue-policy`) on a simulated engine: the same traces as
bench_queueing, the real FcfsQueue and ChameleonQueue code, and the engine's step times from a
linear model fitted on SmolLM2 (`--measure-steps`; no model runs during the simulation). Seconds
per sweep instead of the real benchmark's ~40 minutes, so policies can be compared over ~10x more
requests than a real run affords; its figures are labelled "simulated", and bench_queueing's real
runs are what count.

The simulated engine does what server.engine does each iteration: the policy admits through a
gate (batch rows; memory: KV slots reserved for prompt + max_new_tokens, and with
`--slots-per-rank` each cached adapter's weights in the same memory, idle ones evicted least
recently used first; the prefill token budget); an iteration that admits runs a prefill step of
the admitted prompts only, else a decode step of the running batch. Step times (ms): prefill
`a + b * prompt tokens`, decode `c + d * batch`. `first-fit` is a reference order, not a policy
the server offers: every request that fits starts, so nothing blocks and nothing bounds a wait.
Headlines as bench_queueing's: P99 TTFT ratio at FCFS's highest load within the SLO, and the
ratio of the loads each policy sustains within it.

    python -m bench.queueing_sim --measure-steps float32 --rounds 10 --duration 1200
    python -m bench.queueing_sim --steps '{"prefill_ms": 15, ...}' --memory-tokens 4096 \
        --slots-per-rank 7 --max-batch-size 64 --out bench/results/queueing_sim_flat.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from dataclasses import asdict
from pathlib import Path

from bench.bench_queueing import RANKS, sustained, trace_for
from bench.envelope import describe_device, write_result
from bench.sim_engine import SimLimits, StepModel, measure_steps, simulate
from toppings.scripts.loadgen.stats import percentile
from toppings.server.config import SchedulingConfig
from toppings.server.sched.chameleon import ChameleonQueue
from toppings.server.sched.queueing import FcfsQueue, Verdict

log = logging.getLogger("queueing_sim")


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


POLICIES = {"fcfs": FcfsQueue, "chameleon": ChameleonQueue, "first-fit": FirstFit}


def summarise(records: list, slo_ms: float) -> dict:
    ttft = [1000 * t for t, _, _ in records]
    return {
        "num_requests": len(ttft),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "ttft_p999_ms": percentile(ttft, 99.9),
        "ttft_max_ms": max(ttft),
        "ttft_mean_ms": statistics.fmean(ttft),
        "slo_attainment": sum(t <= slo_ms for t in ttft) / len(ttft),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loads", default="2.0,2.25,2.5,2.75,3.0,3.25", help="request rates, req/s")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals a round")
    p.add_argument("--rounds", type=int, default=3, help="traces per load (seeds)")
    p.add_argument("--slo-ms", type=float, default=6100.0, help="bench_queueing's: 5x E2E alone")
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--output-len", default="lognormal:40:1.0")
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--max-total-tokens", type=int, default=2048)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--memory-tokens", type=int, default=0, help="KV + adapters (0: KV only)")
    p.add_argument(
        "--slots-per-rank",
        type=int,
        default=0,
        help="an adapter's memory in KV slots per rank (SmolLM2 q,k,v float32: 7)",
    )
    p.add_argument("--max-prefill-tokens", type=int, default=8192)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=0,
        help="chunked prefill's step budget (bench/sim_engine.py); 0: whole prompts",
    )
    p.add_argument("--steps", default="{}", help="StepModel fields as JSON")
    p.add_argument(
        "--measure-steps",
        metavar="DTYPE",
        help="fit the step model on the real engine in this dtype first (~1 min)",
    )
    p.add_argument(
        "--steps-source",
        default="StepModel's defaults: measure_steps('float32') of SmolLM2, 2-core Intel Xeon VM "
        "(AMX), 2026-11-25",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/queueing_sim.json"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    steps = StepModel(**json.loads(args.steps))
    if args.measure_steps:
        steps, points = measure_steps(args.measure_steps)
        args.steps_source = (f"measured now: SmolLM2 {args.measure_steps}, {describe_device()}; "
                             f"batch: (prefill ms, decode ms a step) {points}")  # fmt: skip
        log.warning("%s -> %s", args.steps_source, steps)
    ranks = {f"r{r}-{i}": r for r in RANKS for i in range(4)}
    loads = [float(x) for x in args.loads.split(",")]
    table: dict[str, list[dict]] = {pol: [] for pol in POLICIES}
    config = SchedulingConfig(ttft_slo_ms=args.slo_ms)
    for rps in loads:
        for pol in POLICIES:
            records = []
            for rnd in range(args.rounds):
                trace = trace_for(args, ranks, rps, rnd * 100 + int(rps * 1000), args.duration)
                limits = SimLimits(args.memory_tokens or args.max_total_tokens,
                                   args.max_batch_size, args.max_prefill_tokens, ranks,
                                   args.slots_per_rank,
                                   args.max_num_batched_tokens or None)  # fmt: skip
                policy = POLICIES[pol](config, args.max_total_tokens)
                records += simulate(policy, limits, trace, steps)
            row = summarise(records, args.slo_ms)
            table[pol].append(row)
            log.warning("%5.2f req/s %-10s P50 %6.0f  P99 %6.0f  P99.9 %6.0f  max %6.0f ms  "
                        "attainment %.3f", rps, pol, row["ttft_p50_ms"], row["ttft_p99_ms"],
                        row["ttft_p999_ms"], row["ttft_max_ms"], row["slo_attainment"])  # fmt: skip
    write(args, argv, steps, loads, table)


def write(args, argv, steps: StepModel, loads: list[float], table: dict) -> None:
    p99 = {pol: [r["ttft_p99_ms"] for r in rows] for pol, rows in table.items()}
    held = {pol: sustained(loads, p99[pol], args.slo_ms) for pol in table}
    within = [i for i, v in enumerate(p99["fcfs"]) if v <= args.slo_ms]
    at = within[-1] if within else 0
    metrics = {
        "p99_ttft_ratio_vs_fcfs": {pol: p99[pol][at] / p99["fcfs"][at] for pol in table},
        "ratio_load_rps": loads[at],
        "sustained_rps": {pol: v for pol, (v, _) in held.items()},
        "sustained_is_lower_bound": {pol: b for pol, (_, b) in held.items()},
        "sustained_load_ratio_vs_fcfs": {
            pol: v / held["fcfs"][0] if held["fcfs"][0] else None for pol, (v, _) in held.items()
        },
        "loads_rps": loads,
        "per_load": table,
    }
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    config["step_model"] = asdict(steps)
    config["policies"] = {p: f"{c.__module__}.{c.__name__}" for p, c in POLICIES.items()}
    device = "simulated (no model runs)"
    write_result(args.out, "queueing_sim", "queueing_sim", device=device, argv=argv,
                 config=config, metrics=metrics)  # fmt: skip
    log.warning("%s", {k: v for k, v in metrics.items() if k not in ("per_load", "loads_rps")})


if __name__ == "__main__":
    main()
