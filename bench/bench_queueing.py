"""The paper's comparison (Chameleon, MICRO'25) as engine configurations on SmolLM2, side by side.

Five configurations (`--configs`, the table `CONFIGS`), each one engine in process, differ in
the queue policy, in whether adapters no request holds stay on the device, and in whom a load
makes wait:
- `slora`: FCFS, adapters loaded on demand over the emulated link, no cache
  (`--adapter-cache off`: an adapter leaves the device when its last request ends);
- `slora-sync`: the same, but a load stalls the step that needs it (`--lora-mode
  on-demand-sync`), as S-LoRA's router awaits `load_adapters` before a new batch's prefill
  (slora/server/router/manager.py) while the others wait only the request;
- `chameleon-nocache`: Chameleon's multi-level queues, the same loads and no cache;
- `chameleon-nosched`: FCFS with the adapter cache (idle adapters stay, Chameleon's eviction);
- `chameleon`: both.
The others load adapters on demand (`--lora-mode on-demand`: a prefill waits for its adapter)
into the same adapter budget beside the same KV (`--memory-layout static`), a share
`--cache-share` of the adapters' bytes (at least two of the largest), so that the working set
does not fit and the cache matters (`--memory-layout pool`: the same bytes as one memory, where
adapters take what the KV leaves, as in S-LoRA's unified pool that Chameleon caches in);
chunked prefill is on (`--chunked-prefill`). The link (`--link-gbps`, 0: derived) is set so
that loading a rank-64 adapter takes one 128-token prefill on this machine (bench/common.py
link_gbps_for, as bench_single_server sets it).

A heterogeneous trace (`--per-rank` PEFT adapters of each rank 8-128 on q, k, v, equal rank
shares and Zipf popularity within a rank; LMSYS-shaped lognormal lengths, outputs scaled down for
a CPU) is replayed open-loop (Poisson arrivals). At the start of the run:
- the SLO is 5x the mean E2E latency of requests served alone (the paper's rule), on the
  baseline (`chameleon-nosched`, else the first configuration), each request's second run;
- capacity per configuration: the request rate it completes a burst at while the burst still
  saturates the server (the first 75% of its completions);
then loads, fractions of the baseline's capacity, are swept; at each load every configuration
runs the same trace, one after the other, in an order that alternates over rounds (a new trace
per round). Per configuration and load: P50/P99 TTFT, throughput and SLO attainment, pooled over
the rounds, and the per-round P99s. Headlines (`headlines`): Chameleon against S-LoRA at
S-LoRA's highest load within the SLO and in sustained load (against either S-LoRA); the
scheduler alone (`chameleon` against `chameleon-nosched`) in sustained load and at 1.25x the
baseline's capacity.

    python -m bench.bench_queueing [--loads 0.25,0.5,0.75,1.0,1.25,1.5 --duration 40 --rounds 2]
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from bench.common import adapter_bytes, link_gbps_for, prefill_ms, write_random_adapter
from bench.envelope import describe_device, write_result
from bench.queueing_configs import (
    CONFIGS,
    FCFS,
    SEED_SYSTEMS,
    cache_budget,
    engine_config,
    headlines,
    p99_of,
    parse_configs,
    sweep_fractions,
)
from bench.queueing_configs import burst_capacity as configs_burst_capacity
from bench.queueing_configs import sustained as sustained  # other drivers import it from here
from toppings.scripts.loadgen.stats import percentile
from toppings.scripts.loadgen.workload import LengthSpec, WorkloadSpec, build_trace
from toppings.scripts.make_adapters import load_base, make_random_adapter
from toppings.server.config import DTYPE_CHOICES
from toppings.server.memory.layout import kv_slot_bytes
from toppings.server.model.dtype import choose_dtype
from toppings.server.model.loader import load_checkpoint, resolve_model_dir
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.runtime import build_engine

log = logging.getLogger("bench_queueing")
RANKS = (8, 16, 32, 64, 128)
TARGETS = ("q_proj", "k_proj", "v_proj")
LINK_PROMPT_TOKENS = 128  # the link: a rank-64 adapter's load takes one prefill of this many


def make_adapters(
    root: Path, model_dir: Path, per_rank: int, from_shapes: bool = False
) -> dict[str, str]:
    """`per_rank` adapters of each rank (one made per rank, the others copies of it);
    `from_shapes`: drawn from the checkpoint's config.json alone (a weightless checkpoint,
    bench.common.write_random_adapter) instead of through its transformers model."""
    paths, base = {}, None
    for rank in RANKS:
        for i in range(per_rank):
            name, path = f"r{rank}-{i}", root / f"r{rank}-{i}"
            if not (path / "adapter_model.safetensors").is_file():
                if i == 0 and from_shapes:
                    write_random_adapter(path, str(model_dir), rank, TARGETS, seed=rank)
                elif i == 0:
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


def submit_trace(engine, trace, burst: bool = False, wrap=lambda handle: handle) -> list:
    """Submit each entry (greedy, exactly its max tokens) at its arrival time, all at once with
    `burst`; `wrap` of each request's handle (applied at once, before its first output can
    come), in trace order."""
    start = time.monotonic()
    handles = []
    for e in trace:
        if not burst:
            time.sleep(max(0.0, start + e.arrival_s - time.monotonic()))
        params = SamplingParams(max_new_tokens=e.max_tokens, temperature=0.0, ignore_eos=True)
        handles.append(
            wrap(
                engine.submit(
                    GenerationRequest(list(e.prompt), params, engine.resolve_adapter(e.model))
                )
            )
        )
    return handles


def replay(engine, trace, burst: bool = False) -> list[dict]:
    """Submit each entry at its arrival time (all at once with `burst`); wait for all. A
    request the engine failed is a bug, not a data point: RuntimeError naming it."""
    start = time.monotonic()
    handles = submit_trace(engine, trace, burst)
    records = []
    for e, h in zip(trace, handles):
        out = h.result(timeout_s=3600)
        if out.error is not None:
            raise RuntimeError(f"the engine failed a request of the trace: {out.error}")
        records.append({"ttft_s": out.ttft_s, "e2e_s": out.e2e_s, "tokens": out.output_tokens,
                        "rank": e.rank, "size": len(e.prompt) + e.max_tokens})  # fmt: skip
    records_span = time.monotonic() - start
    for r in records:
        r["span_s"] = records_span
    return records


def slo_ms_alone(engine, trace, twice: bool = False) -> float:
    """The SLO in ms (the paper's rule): 5x the mean E2E latency of `trace`'s requests, each
    served alone (`twice`: each served twice in a row and the second timed, so that it finds
    its adapter loaded)."""
    runs = 2 if twice else 1
    e2e = [[replay(engine, [e], burst=True) for _ in range(runs)][-1][0]["e2e_s"] for e in trace]
    return 5000 * statistics.fmean(e2e)


def burst_capacity(records: list[dict]) -> float:
    """Requests/s while a burst (`replay(..., burst=True)`'s records) still saturates the
    server (queueing_configs.burst_capacity of their E2E latencies)."""
    return configs_burst_capacity([r["e2e_s"] for r in records])


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


COLOURS = {"slora": "tab:red", "slora-sync": "tab:purple", "chameleon-nocache": "tab:orange",
           "chameleon-nosched": "tab:green", "chameleon": "tab:blue"}  # fmt: skip


def plot(path: Path, series: list[tuple[str, list[float], dict, bool]], slo_ms: float,
         title: str) -> None:  # fmt: skip
    """P99 TTFT against load per configuration; series: (label, loads, {config: rows},
    simulated): real points filled on solid lines, simulated ones hollow on dashed lines; a
    load at which some run stalled (the simulator's num_stalled_runs) is a cross at the top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    for label, loads, per_config, simulated in series:
        for name, rows in per_config.items():
            style = dict(
                color=COLOURS.get(name, "k"),
                ls="--" if simulated else "-",
                marker="o",
                mfc="none" if simulated else COLOURS.get(name, "k"),
            )
            p99_s = [v / 1000 if math.isfinite(v) else math.nan for v in p99_of(rows)]
            ax.plot(loads, p99_s, label=f"{name} ({label})", **style)
    ax.axhline(slo_ms / 1000, color="k", ls=":", label="SLO")
    ax.set_yscale("log")
    top = ax.get_ylim()[1]
    for label, loads, per_config, _ in series:
        for name, rows in per_config.items():
            stalled = [x for x, r in zip(loads, rows) if r.get("num_stalled_runs")]
            if stalled:
                ax.plot(stalled, [top] * len(stalled), "x", color=COLOURS.get(name, "k"),
                        label=f"{name} ({label}): a run stalled")  # fmt: skip
    ax.set_xlabel("load (requests/s)")
    ax.set_ylabel("P99 TTFT (s)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The trace's and the engines' arguments, shared with bench/queueing_sim.py."""
    p.add_argument("--configs", default=",".join(SEED_SYSTEMS), help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--per-rank", type=int, default=4, help="adapters per rank")
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--output-len", default="lognormal:40:1.0")
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--max-total-tokens", type=int, default=2048)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-prefill-tokens", type=int, default=8192,
                   help="prompt tokens a step may take with chunked prefill off")  # fmt: skip
    p.add_argument("--chunked-prefill", default="on", choices=("on", "off"))
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="chunked prefill's step budget (0: the engine's derived one)")  # fmt: skip
    p.add_argument("--cache-share", type=float, default=0.25,
                   help="the adapter budget: this share of all adapters' bytes")  # fmt: skip
    p.add_argument("--link-gbps", type=float, default=0.0,
                   help="emulated link (0: a rank-64 load = one 128-token prefill)")  # fmt: skip
    p.add_argument("--memory-layout", default="static", choices=("static", "pool"),
                   help="static: the adapter budget beside --max-total-tokens of KV; pool: "
                        "both in one memory of the same bytes, adapters cached in what KV "
                        "leaves free (as S-LoRA's and Chameleon's)")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("--loads", default="0.25,0.5,0.75,1.0,1.25,1.5",
                   help="fractions of the baseline's capacity (1.25 always added)")  # fmt: skip
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPE_CHOICES,
        help="the engines' dtype (auto: what toppings-serve picks on this machine)",
    )
    p.add_argument("--alone", type=int, default=8, help="requests served alone for the SLO")
    p.add_argument("--burst", type=int, default=32, help="requests of the capacity burst")
    p.add_argument("--adapter-dir", type=Path, default=Path("/tmp/toppings-queueing-adapters"))
    p.add_argument("--out", type=Path, default=Path("bench/results/queueing.json"))
    p.add_argument("--plot", type=Path, default=Path("bench/queueing_ttft.png"))
    p.add_argument("--sim", type=Path, help="a queueing_sim.json to draw beside (hollow points)")
    args = p.parse_args(argv)
    args.chunked_prefill = args.chunked_prefill == "on"
    names = parse_configs(args.configs)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model_dir = resolve_model_dir("smollm2")
    mc = load_checkpoint(str(model_dir), "dummy").config  # shapes only
    if args.dtype == "auto":  # resolved once: the adapters' bytes and every engine use it
        args.dtype, why = choose_dtype("cpu", mc.hidden_size, mc.intermediate_size)
        log.info("dtype auto: %s (%s)", args.dtype, why)
    adapters = make_adapters(args.adapter_dir, model_dir, args.per_rank)
    nbytes = {r: adapter_bytes(adapters[f"r{r}-0"], str(model_dir), _torch_dtype(args.dtype))
              for r in RANKS}  # fmt: skip
    cache_bytes = cache_budget(nbytes, args.per_rank, args.cache_share)
    slot_bytes = kv_slot_bytes(mc, _torch_dtype(args.dtype).itemsize)
    link_gbps = args.link_gbps
    if not link_gbps:
        prompt = list(range(100, 100 + LINK_PROMPT_TOKENS))
        link_gbps = link_gbps_for(nbytes[64], prefill_ms(str(model_dir), args.dtype, prompt) / 1000)
    base = FCFS if FCFS in names else names[0]

    def engine(name: str, slo_ms: float = 5000.0, step_model=None):
        config = engine_config(name, args, link_gbps, cache_bytes, slo_ms, slot_bytes)
        return build_engine(str(model_dir), config, adapters, step_model=step_model)

    engines = {base: engine(base)}
    shared = engines[base].step_model  # measured once: every configuration has the same budget
    alone = trace_for(args, adapters, 1.0, 999, None, args.alone)
    slo_ms = slo_ms_alone(engines[base], alone, twice=True)
    for name in names:
        engines.setdefault(name, engine(name, slo_ms, shared))
    burst = trace_for(args, adapters, 1.0, 998, None, args.burst)
    capacity = {n: burst_capacity(replay(engines[n], burst, burst=True)) for n in names}
    log.info("SLO %.0f ms; capacity %s; link %.3f Gbit/s; adapter budget %d bytes",
             slo_ms, capacity, link_gbps, cache_bytes)  # fmt: skip
    fractions, overload_idx = sweep_fractions(args.loads)
    loads = [f * capacity[base] for f in fractions]
    raw: dict[str, list[list[list[dict]]]] = {n: [[] for _ in loads] for n in names}
    for rnd in range(args.rounds):
        for i, rps in enumerate(loads):
            trace = trace_for(args, adapters, rps, seed=rnd * 100 + i, duration=args.duration)
            order = names if (rnd + i) % 2 == 0 else names[::-1]
            for name in order:
                raw[name][i].append(replay(engines[name], trace))
                log.info("round %d load %.2f rps %s: %s", rnd, rps, name,
                         summarise(raw[name][i][-1:], slo_ms / 1000, args.duration))  # fmt: skip
    views = {n: {"queueing": engines[n].stats().to_json()["queueing"],
                 "adapter_cache": asdict(engines[n].counters().adapter_cache)}
             for n in names}  # fmt: skip
    dtype = args.dtype
    for e in engines.values():
        e.shutdown()
    per_config = {n: [summarise(runs, slo_ms / 1000, args.duration) for runs in raw[n]]
                  for n in names}  # fmt: skip
    run = {"dtype": dtype, "slo_ms": slo_ms, "capacity": capacity, "fractions": fractions,
           "loads": loads, "overload_idx": overload_idx, "link_gbps": link_gbps,
           "cache_bytes": cache_bytes, "adapter_bytes_per_rank": nbytes[8] // 8,
           "step_budget": {n: e.step_budget and e.step_budget.tokens
                           for n, e in engines.items()},
           # as each engine's refit left it (server.sched.step_refit): what the simulator's
           # validation runs on (queueing_sim --validate)
           "step_models": {n: e.step_model and asdict(e.step_model)
                           for n, e in engines.items()}}  # fmt: skip
    write(args, argv, run, per_config, views)


def _torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)


def write(args, argv, run: dict, per_config: dict, views: dict) -> None:
    p99 = {n: p99_of(rows) for n, rows in per_config.items()}
    loads, slo_ms = run["loads"], run["slo_ms"]
    metrics = {
        **headlines(loads, p99, slo_ms, run["overload_idx"]),
        "slo_ms": slo_ms,
        "capacity_rps": run["capacity"],
        "loads_rps": loads,
        "load_fractions_of_baseline_capacity": run["fractions"],
        "link_gbps": run["link_gbps"],
        "adapter_cache_bytes": run["cache_bytes"],
        "adapter_bytes_per_rank": run["adapter_bytes_per_rank"],
        "step_budget_tokens": run["step_budget"],
        "step_models": run["step_models"],
        "per_load": per_config,
        "adapter_cache_at_end": {n: v["adapter_cache"] for n, v in views.items()},
        "queues_at_end": {n: v["queueing"] for n, v in views.items()},
    }
    write_result(
        args.out,
        "queueing",
        "bench_queueing",
        device=describe_device(),
        argv=argv,
        config={
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "model": f"SmolLM2-135M-Instruct ({run['dtype']}), in-process engines",
            "configs": {n: asdict(CONFIGS[n]) for n in per_config},
            "shared": f"memory-layout {args.memory_layout} (static: --max-total-tokens of KV "
            "beside the adapter budget, adapter_cache_bytes; pool: one memory of both), the "
            "emulated link (link_gbps)",
            "ranks": list(RANKS),
            "targets": list(TARGETS),
            "popularity": "equal rank shares, zipf(1.0) over the adapters of a rank",
            "prompt_len": "lmsys lognormal (mean 69.5, sigma 1)",
            "slo_rule": f"5x mean E2E of {args.alone} requests served alone (second run)",
            "capacity_rule": "a burst submitted at once: 75% of its requests / the time the "
            "75th percent took to complete",
            "link_rule": f"a rank-64 adapter's load takes one {LINK_PROMPT_TOKENS}-token prefill "
            "unless --link-gbps",
        },
        metrics=metrics,
    )
    series = [("real", loads, per_config, False)]
    if args.sim is not None and args.sim.is_file():
        series.append(sim_series(args.sim))
    title = (f"SmolLM2 CPU {run['dtype']}, {args.memory_layout} KV {args.max_total_tokens}, "
             f"chunked prefill {'on' if args.chunked_prefill else 'off'}, "
             f"ranks 8-128 x {args.per_rank}, "
             f"{args.rounds} rounds x {args.duration:.0f} s per point")  # fmt: skip
    plot(args.plot, series, slo_ms, title)
    log.info("%s", {k: v for k, v in metrics.items() if k not in ("per_load",)})


def sim_series(path: Path) -> tuple[str, list[float], dict, bool]:
    """A queueing_sim.json's curves for `plot` (hollow points)."""
    import json

    metrics = json.loads(path.read_text())["metrics"]
    return "simulated", metrics["loads_rps"], metrics["per_load"], True


if __name__ == "__main__":
    main()
