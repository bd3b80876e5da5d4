"""Simulated cluster: every routing policy on the same trace, at the paper's load and a sweep.

    python -m bench.cluster_sim [--servers 60] [--rps 340] [--duration 60]
        [--loads 200,260,300,340,380,420] [--kernels bgmv,mbgmv] [--perf-model FILE.json]

Writes bench/results/cluster_sim.json (--out), bench/cluster_sim_slo.png (SLO attainment vs
load) and bench/cluster_sim_tpt_cdf.png (TPT CDF at the paper's load), the PNGs named after
--out one folder up. The SLO on time per token is 1.5x
the mean TPT of the same trace served without LoRA (every rank 0, least-loaded routing), at the
paper's load, and stays fixed over the sweep. Without --perf-model the iteration latencies come
from the paper's Fig. 6 (scheduler/paper_models.py), and the result says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.envelope import write_result
from toppings.scheduler.paper_models import paper_fig6_models
from toppings.scheduler.perf_model import PerfModels
from toppings.scheduler.policies import POLICIES, LoRAServe, make_policy
from toppings.scheduler.sim.simulator import SimConfig, simulate
from toppings.scheduler.sim.trace import TraceConfig, generate_trace, trace_summary

log = logging.getLogger("cluster_sim")
# The routing policies; loraserve places adapters too and has its own driver
# (bench/bench_cluster_placement.py, with drift and its placement clock).
ROUTING = [name for name, cls in POLICIES.items() if not issubclass(cls, LoRAServe)]
NO_SLO_MS = 1e9  # the no-LoRA run only measures TPT; nothing is over its SLO


@dataclasses.dataclass(frozen=True)
class Job:
    kernel: str
    rps: float
    policy: str  # "no-lora" for the SLO baseline
    slo_ms: float
    duration_s: float
    num_servers: int
    seed: int
    perf_model: str | None
    keep_tpt: bool = False


def load_perf(path: str | None) -> PerfModels:
    return paper_fig6_models() if path is None else PerfModels.load(path)


def run_job(job: Job) -> dict:
    """One simulation; returns its summary (and every measured TPT when asked)."""
    perf = load_perf(job.perf_model)
    trace = generate_trace(TraceConfig(rps=job.rps, duration_s=job.duration_s, seed=job.seed))
    avg_resp_len = sum(r.output_tokens for r in trace) / len(trace)
    name = job.policy
    if name == "no-lora":
        trace = [dataclasses.replace(r, rank=0) for r in trace]
        name = "least-loaded"
    policy = make_policy(name, perf, job.slo_ms, avg_resp_len, seed=job.seed)
    config = SimConfig(num_servers=job.num_servers, kernel=job.kernel)
    started = time.perf_counter()
    result = simulate(trace, policy, perf, config)
    summary = result.summary(job.slo_ms)
    summary["sim_wall_s"] = time.perf_counter() - started
    out = {"job": dataclasses.asdict(job), "summary": summary}
    if job.keep_tpt:
        out["tpt_ms"] = result.tpt_ms()
    log.info("%s %s %.0f rps: %s", job.kernel, job.policy, job.rps, summary)
    return out


def plot(sweep: dict, tpt_ms: dict, slo_ms: dict, kernels: list[str], prefix: Path,
         rps: float, source: str) -> None:  # fmt: skip
    """Draws PREFIX_slo.png and PREFIX_tpt_cdf.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kernel, style, marker in zip(kernels, ("-", "--"), ("o", "x")):
        for color, (name, points) in enumerate(sweep[kernel].items()):
            loads = [p["rps"] for p in points]
            attained = [p["slo_attainment"] for p in points]
            label = f"{name} ({kernel})"
            ax.plot(loads, attained, style, marker=marker, color=f"C{color}", label=label)
    ax.axvline(rps, color="grey", lw=0.8)
    ax.set_xlabel("load (requests/s, 60 servers)")
    ax.set_ylabel("SLO attainment (TPT <= SLO)")
    ax.set_title("Simulated cluster; perf models: " + source)
    ax.title.set_fontsize(8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{prefix}_slo.png", dpi=120)

    fig, ax = plt.subplots(figsize=(6, 4))
    kernel = kernels[0]
    right = 0.0
    for name, tpt in tpt_ms[kernel].items():
        tpt = sorted(tpt)
        ax.plot(tpt, [(i + 1) / len(tpt) for i in range(len(tpt))], label=name)
        right = max(right, tpt[int(0.995 * (len(tpt) - 1))])
    ax.set_xlim(0, 1.1 * right)  # the last 0.5% (one-token answers that queued) would dwarf it
    ax.axvline(slo_ms[kernel], color="grey", lw=0.8, ls=":")
    ax.set_xlabel("time per token (ms)")
    ax.set_ylabel("CDF")
    ax.set_title(f"{kernel}, {rps:.0f} rps, up to the 99.5th percentile; dotted: SLO", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{prefix}_tpt_cdf.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", type=int, default=60)
    parser.add_argument("--rps", type=float, default=340.0, help="the paper's load")
    parser.add_argument("--duration", type=float, default=60.0, help="trace length, seconds")
    parser.add_argument("--loads", default="200,260,300,340,380,420", help="sweep, rps")
    parser.add_argument("--kernels", default="bgmv,mbgmv")
    parser.add_argument("--perf-model", help="fitted perf-model JSON (default: paper Fig. 6)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results/cluster_sim.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    kernels = args.kernels.split(",")
    loads = sorted({float(x) for x in args.loads.split(",")} | {args.rps})
    perf = load_perf(args.perf_model)
    source = perf.source if args.perf_model is None else f"fitted: {args.perf_model}"
    common = dict(duration_s=args.duration, num_servers=args.servers, seed=args.seed,
                  perf_model=args.perf_model)  # fmt: skip
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        baseline_jobs = [Job(k, args.rps, "no-lora", NO_SLO_MS, **common) for k in kernels]
        baselines = list(pool.map(run_job, baseline_jobs))
        slo = {k: 1.5 * b["summary"]["mean_tpt_ms"] for k, b in zip(kernels, baselines)}
        jobs = [
            Job(k, rps, name, slo[k], keep_tpt=rps == args.rps and k == kernels[0], **common)
            for k in kernels
            for rps in loads
            for name in ROUTING
        ]
        runs = list(pool.map(run_job, jobs))

    at_paper_load = {k: {} for k in kernels}
    sweep: dict[str, dict[str, list]] = {k: {name: [] for name in ROUTING} for k in kernels}
    tpt_lists: dict[str, dict[str, list]] = {k: {} for k in kernels}
    for run in runs:
        job, summary = run["job"], run["summary"]
        sweep[job["kernel"]][job["policy"]].append({"rps": job["rps"], **summary})
        if job["rps"] == args.rps:
            at_paper_load[job["kernel"]][job["policy"]] = summary
            if "tpt_ms" in run:
                tpt_lists[job["kernel"]][job["policy"]] = run["tpt_ms"]
    head = at_paper_load[kernels[0]]
    ours = head["rank-aware"]["mean_tpt_ms"]
    trace = generate_trace(TraceConfig(rps=args.rps, duration_s=args.duration, seed=args.seed))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    prefix = args.out.parent.parent / args.out.stem
    plot(sweep, tpt_lists, slo, kernels, prefix, args.rps, source)
    results = write_result(
        args.out,
        "cluster_sim",
        "cluster_sim",
        device="simulation (pure Python discrete-event; no hardware measured)",
        argv=argv,
        config={
            "perf_model_source": source,
            "perf_model_note": (
                "decode: Eq. 2 through Fig. 6's four latencies; prefill: assumed (the paper gives"
                " none), see scheduler/paper_models.py"
                if args.perf_model is None
                else "fitted on measured engine iterations"
            ),
            "perf_models": {key: m.to_json() for key, m in sorted(perf.models.items())},
            "num_servers": args.servers,
            "rps": args.rps,
            "loads": loads,
            "headline_kernel": kernels[0],
            "trace": dataclasses.asdict(
                TraceConfig(rps=args.rps, duration_s=args.duration, seed=args.seed)
            ),  # fmt: skip
            "trace_at_paper_load": trace_summary(trace),
            "sim": dataclasses.asdict(SimConfig(num_servers=args.servers)),
            "slo": "TPT <= 1.5 x mean TPT of the same trace without LoRA (rank 0, least-loaded)"
            " at the paper's load; fixed over the sweep",
            "tpt": "end-to-end latency / output tokens (prefill and queueing included)",
        },
        metrics={
            "slo_attainment": {n: s["slo_attainment"] for n, s in head.items()},
            "mean_tpt_ms": {n: s["mean_tpt_ms"] for n, s in head.items()},
            "tpt_reduction_rank_aware_vs": {
                n: 1.0 - ours / s["mean_tpt_ms"] for n, s in head.items() if n != "rank-aware"
            },
            "slo_tpt_ms": slo,
            "no_lora_mean_tpt_ms": {
                k: b["summary"]["mean_tpt_ms"] for k, b in zip(kernels, baselines)
            },
            "at_paper_load": at_paper_load,
            "sweep": sweep,
            "wall_s": time.perf_counter() - started,
        },
    )
    headline = ("slo_attainment", "mean_tpt_ms", "tpt_reduction_rank_aware_vs", "slo_tpt_ms")
    print(json.dumps({k: results["metrics"][k] for k in headline}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
