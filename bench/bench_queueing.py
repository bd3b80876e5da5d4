"""FCFS against Chameleon's multi-level queues (`--queue-policy`) on SmolLM2, side by side.

A heterogeneous trace (PEFT adapters of ranks 8-128 on q, k, v, equal rank shares and Zipf
popularity within a rank; LMSYS-shaped lognormal lengths, outputs scaled down for a CPU) is
replayed open-loop (Poisson arrivals) against two in-process engines that differ only in the
queue policy. The KV cache is small enough to bind (as GPU memory does in the paper), so that
requests queue. On a CPU a prefill step is slow (SmolLM2 in float32 at the ~200 GFLOP/s of
engine_throughput_float32.json: ~0.7 s per 500 prompt tokens on 2 cores): with the engine's
default budget of 8192 prompt tokens a step, every request admitted together waits for the whole
step; `--max-prefill-tokens` bounds a step. At the start of the run:
- the SLO is 5x the mean E2E latency of requests served alone (the paper's rule);
- capacity is the request rate FCFS completes a burst at while it still saturates the server
  (the first 75% of its completions);
then loads from half of that capacity to past it are swept; at each load the two policies run
the same trace one after the other, in alternating order over rounds (a new trace per round).
Per policy and load: P50/P99 TTFT, throughput and SLO attainment (TTFT within the SLO), pooled
over the rounds, and the per-round P99s for the spread. Headlines: `p99_ttft_ratio_vs_fcfs` at
the highest load at which FCFS's P99 TTFT meets the SLO, and `sustained_load_ratio_vs_fcfs`,
the ratio of the loads each policy sustains within the SLO (linear between sweep points).

    python -m bench.bench_queueing [--loads 0.5,0.8,1.0,1.2,1.4 --duration 40 --rounds 2]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import time
from pathlib import Path

from bench.envelope import describe_device, write_result
from toppings.scripts.loadgen.stats import percentile
from toppings.scripts.loadgen.workload import LengthSpec, WorkloadSpec, build_trace
from toppings.scripts.make_adapters import load_base, make_random_adapter
from toppings.server.config import DTYPE_CHOICES, EngineConfig
from toppings.server.model.loader import resolve_model_dir
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.runtime import build_engine

log = logging.getLogger("bench_queueing")
RANKS = (8, 16, 32, 64, 128)
POLICIES = ("fcfs", "chameleon")
TARGETS = ("q_proj", "k_proj", "v_proj")
CAPACITY_SHARE = 0.75  # capacity: completions per second until 75% of a burst has completed


def make_adapters(root: Path, model_dir: Path, per_rank: int) -> dict[str, str]:
    """`per_rank` adapters of each rank (one made per rank, the others copies of it)."""
    paths, base = {}, None
    for rank in RANKS:
        for i in range(per_rank):
            name, path = f"r{rank}-{i}", root / f"r{rank}-{i}"
            if not (path / "adapter_model.safetensors").is_file():
                if i == 0:
                    base = base or load_base(model_dir)
                    make_random_adapter(path, base, rank=rank, target_modules=TARGETS, seed=rank)
                else:
                    shutil.copytree(root / f"r{rank}-0", path)
            paths[name] = str(path)
    return paths


def trace_for(
    args, adapters: dict[str, object], rps: float, seed: int, duration: float | None, num=None
):
    """The trace at `rps` over the adapters named by `adapters`' keys ("r<rank>-<i>")."""
    spec = WorkloadSpec(
        rps=rps,
        duration_s=duration,
        num_requests=num,
        popularity="zipf",
        rank_mix=tuple((r, 1.0) for r in RANKS),
        prompt_len=LengthSpec.parse("lmsys", args.max_prompt_len, "prompt"),
        output_len=LengthSpec.parse(args.output_len, args.max_output_len, "output"),
        seed=seed,
    )
    ranks = {n: int(n[1:].split("-")[0]) for n in adapters}
    return build_trace(spec, ranks)


def replay(engine, trace, burst: bool = False) -> list[dict]:
    """Submit each entry at its arrival time (all at once with `burst`); wait for all."""
    start = time.monotonic()
    handles = []
    for e in trace:
        if not burst:
            time.sleep(max(0.0, start + e.arrival_s - time.monotonic()))
        params = SamplingParams(max_new_tokens=e.max_tokens, temperature=0.0, ignore_eos=True)
        handles.append(engine.submit(GenerationRequest(list(e.prompt), params, e.model)))
    records = []
    for e, h in zip(trace, handles):
        out = h.result(timeout_s=3600)
        records.append({"ttft_s": out.ttft_s, "e2e_s": out.e2e_s, "tokens": out.output_tokens,
                        "rank": e.rank, "size": len(e.prompt) + e.max_tokens})  # fmt: skip
    records_span = time.monotonic() - start
    for r in records:
        r["span_s"] = records_span
    return records


def slo_ms_alone(engine, trace) -> float:
    """The SLO in ms (the paper's rule): 5x the mean E2E latency of `trace`'s requests, each
    served alone."""
    return 5000 * statistics.fmean(replay(engine, [e], burst=True)[0]["e2e_s"] for e in trace)


def burst_capacity(records: list[dict]) -> float:
    """Requests/s while a burst (`replay(..., burst=True)`'s records) still saturates the
    server: the first CAPACITY_SHARE of it to complete over the time the last of those took."""
    done = sorted(r["e2e_s"] for r in records)
    k = max(1, int(CAPACITY_SHARE * len(done)))
    return k / done[k - 1]


def summarise(runs: list[list[dict]], slo_s: float, duration: float) -> dict:
    """Pooled over rounds: TTFT percentiles (ms), throughput, SLO attainment."""
    records = [r for run in runs for r in run]
    ttft = [1000 * r["ttft_s"] for r in records]
    span = sum(run[0]["span_s"] for run in runs)
    return {
        "num_requests": len(records),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "ttft_mean_ms": statistics.fmean(ttft),
        "ttft_p99_ms_per_round": [
            percentile([1000 * r["ttft_s"] for r in run], 99) for run in runs
        ],
        "slo_attainment": sum(t <= 1000 * slo_s for t in ttft) / len(ttft),
        "throughput_rps": len(records) / span,
        "output_tokens_per_s": sum(r["tokens"] for r in records) / span,
        "e2e_mean_ms": statistics.fmean(1000 * r["e2e_s"] for r in records),
        "tail": tail_profile(records),
    }


def tail_profile(records: list[dict]) -> dict:
    """Who the slowest 1% are (TTFT at or above the pooled P99) against all requests: their
    size (prompt + max tokens) and rank. A tail of short requests is head-of-line blocking,
    what multi-level queues remove; a tail of long ones is their own queueing and prefill."""
    cut = percentile([r["ttft_s"] for r in records], 99)
    tail = [r for r in records if r["ttft_s"] >= cut]
    sizes = sorted(r["size"] for r in records)
    top_quartile = sizes[(3 * len(sizes)) // 4]
    return {
        "num": len(tail),
        "median_size": statistics.median(r["size"] for r in tail),
        "median_size_all": statistics.median(sizes),
        "share_in_top_size_quartile": sum(r["size"] >= top_quartile for r in tail) / len(tail),
        "mean_rank": statistics.fmean(r["rank"] for r in tail),
        "mean_rank_all": statistics.fmean(r["rank"] for r in records),
    }


def sustained(loads: list[float], p99s: list[float], slo_ms: float) -> tuple[float, bool]:
    """The load at which P99 TTFT crosses the SLO (linear between points); True if it never
    does within the sweep (the value is then a lower bound: the highest load run)."""
    if p99s[0] > slo_ms:
        return 0.0, False
    for i in range(1, len(loads)):
        if p99s[i] > slo_ms:
            a, b = p99s[i - 1], p99s[i]
            return loads[i - 1] + (loads[i] - loads[i - 1]) * (slo_ms - a) / (b - a), False
    return loads[-1], True


def plot(path: Path, loads: list[float], per_policy: dict, slo_ms: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for policy, style in zip(POLICIES, ("tab:red", "tab:blue")):
        rows = per_policy[policy]
        ax.plot(loads, [r["ttft_p99_ms"] / 1000 for r in rows], "o-", color=style,
                label=f"{policy} P99")  # fmt: skip
        ax.plot(loads, [r["ttft_p50_ms"] / 1000 for r in rows], "s--", color=style,
                label=f"{policy} P50", alpha=0.6)  # fmt: skip
    ax.axhline(slo_ms / 1000, color="k", ls=":", label="SLO")
    ax.set_yscale("log")
    ax.set_xlabel("load (requests/s)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loads", default="0.5,0.8,1.0,1.2,1.4", help="fractions of capacity")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--per-rank", type=int, default=4, help="adapters per rank")
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--output-len", default="lognormal:40:1.0")
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--max-total-tokens", type=int, default=2048)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPE_CHOICES,
        help="the engines' dtype (auto: what toppings-serve picks on this machine)",
    )
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=8192,
        help="prompt tokens one prefill step may take (the engine's default)",
    )
    p.add_argument("--alone", type=int, default=8, help="requests served alone for the SLO")
    p.add_argument("--burst", type=int, default=32, help="requests of the capacity burst")
    p.add_argument("--adapter-dir", type=Path, default=Path("/tmp/toppings-queueing-adapters"))
    p.add_argument("--out", type=Path, default=Path("bench/results/queueing.json"))
    p.add_argument("--plot", type=Path, default=Path("bench/queueing_ttft.png"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model_dir = resolve_model_dir("smollm2")
    adapters = make_adapters(args.adapter_dir, model_dir, args.per_rank)

    def engine(policy: str, slo_ms: float = 5000.0):
        config = EngineConfig(dtype=args.dtype, max_total_tokens=args.max_total_tokens,
                              max_batch_size=args.max_batch_size, queue_policy=policy,
                              max_prefill_tokens=args.max_prefill_tokens,
                              ttft_slo_ms=slo_ms)  # fmt: skip
        return build_engine(str(model_dir), config, adapters)

    engines = {"fcfs": engine("fcfs")}
    slo_ms = slo_ms_alone(engines["fcfs"], trace_for(args, adapters, 1.0, 999, None, args.alone))
    burst = trace_for(args, adapters, 1.0, 998, None, args.burst)
    capacity = {}
    engines["chameleon"] = engine("chameleon", slo_ms)
    for policy in POLICIES:  # also the warm-up: chameleon's first queues come from this burst
        capacity[policy] = burst_capacity(replay(engines[policy], burst, burst=True))
    log.info("SLO %.0f ms; capacity %s", slo_ms, capacity)
    fractions = [float(x) for x in args.loads.split(",")]
    loads = [f * capacity["fcfs"] for f in fractions]
    raw: dict[str, list[list[list[dict]]]] = {pol: [[] for _ in loads] for pol in POLICIES}
    for rnd in range(args.rounds):
        for i, rps in enumerate(loads):
            trace = trace_for(args, adapters, rps, seed=rnd * 100 + i, duration=args.duration)
            order = POLICIES if (rnd + i) % 2 == 0 else POLICIES[::-1]
            for policy in order:
                raw[policy][i].append(replay(engines[policy], trace))
                log.info("round %d load %.2f rps %s: %s", rnd, rps, policy,
                         summarise(raw[policy][i][-1:], slo_ms / 1000, args.duration))  # fmt: skip
    views = {pol: engines[pol].stats().to_json()["queueing"] for pol in POLICIES}
    for e in engines.values():
        e.shutdown()
    per_policy = {
        pol: [summarise(runs, slo_ms / 1000, args.duration) for runs in raw[pol]]
        for pol in POLICIES
    }
    dtype = engines["fcfs"].config.dtype  # "auto" resolved
    write(args, argv, dtype, slo_ms, capacity, fractions, loads, per_policy, views)


def write(args, argv, dtype, slo_ms, capacity, fractions, loads, per_policy, views) -> None:
    p99 = {pol: [r["ttft_p99_ms"] for r in per_policy[pol]] for pol in POLICIES}
    held = {pol: sustained(loads, p99[pol], slo_ms) for pol in POLICIES}
    within = [i for i, v in enumerate(p99["fcfs"]) if v <= slo_ms]
    at = within[-1] if within else 0
    metrics = {
        "p99_ttft_ratio_vs_fcfs": p99["chameleon"][at] / p99["fcfs"][at],
        "p50_ttft_ratio_vs_fcfs": per_policy["chameleon"][at]["ttft_p50_ms"]
        / per_policy["fcfs"][at]["ttft_p50_ms"],
        "ratio_load_rps": loads[at],
        "ratio_load_fraction_of_capacity": fractions[at],
        "sustained_load_ratio_vs_fcfs": held["chameleon"][0] / held["fcfs"][0]
        if held["fcfs"][0]
        else None,
        "sustained_rps": {pol: held[pol][0] for pol in POLICIES},
        "sustained_is_lower_bound": {pol: held[pol][1] for pol in POLICIES},
        "slo_ms": slo_ms,
        "capacity_rps": capacity,
        "loads_rps": loads,
        "per_load": per_policy,
        "chameleon_queues_at_end": views["chameleon"],
    }
    write_result(
        args.out,
        "queueing",
        "bench_queueing",
        device=describe_device(),
        argv=argv,
        config={
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "model": f"SmolLM2-135M-Instruct ({dtype}), in-process engines, lora-mode cached",
            "ranks": list(RANKS),
            "targets": list(TARGETS),
            "popularity": "equal rank shares, zipf(1.0) over the adapters of a rank",
            "prompt_len": "lmsys lognormal (mean 69.5, sigma 1)",
            "slo_rule": f"5x mean E2E of {args.alone} requests served alone",
            "capacity_rule": "a burst submitted at once: 75% of its requests / the time the "
            "75th percent took to complete, FCFS (the tail of a burst runs unsaturated)",
        },
        metrics=metrics,
    )
    title = (f"SmolLM2 CPU {dtype}, KV {args.max_total_tokens}, prefill "
             f"{args.max_prefill_tokens} tokens, ranks 8-128, "
             f"{args.rounds} rounds x {args.duration:.0f} s per point")  # fmt: skip
    plot(args.plot, loads, per_policy, slo_ms, title)
    log.info("%s", {k: v for k, v in metrics.items() if k not in ("per_load",)})


if __name__ == "__main__":
    main()
