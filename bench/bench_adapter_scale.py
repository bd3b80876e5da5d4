"""A thousand adapters through a device room for eight: does a cold adapter cost what a warm one
does? P99 TTFT and throughput of `toppings-serve` under three adapter assignments at one rate.

1,024 PEFT adapters (ranks 8, 16, 32, 64 in turn, on q, k, v and o of every layer of SmolLM2),
each its own random weights (bench.common.write_random_adapter: distinct contents, so no two
share a host copy), written once under `--adapter-dir` (~/.cache/toppings/bench_adapters/...),
about 7 GB. A server finds them on first use (`--lora-resolver dir:ADAPTER_DIR`), as a fleet of
a thousand adapters would, so a cold adapter is read from disk on its request's path; with
`--adapters registered` it registers them all at start-up instead (`--lora-dir`: every file read
once, every adapter in host memory, as Toppings keeps them), so a cold adapter only loads from
host memory to the device room. The device room (`--adapter-cache-bytes`) is `--slots` (8)
times the mean adapter's bytes at the server's dtype, in the static memory layout, so that the
room is that and no more. Each memory layout of `--layouts` runs with that room: `static` (KV of
`--max-total-tokens` and the room apart) and `pool` (the default: one budget of the same bytes,
where KV blocks take what adapters leave and adapters, never past the room, take blocks back from
idle KV). Everything else is the server's default: no emulated link (a load is a copy), the
default lora mode, the default resolver bounds.

At the start of each round, the default mode's server measures its capacity on a burst of
`--burst` requests for one warm adapter (all of them over the time the last took); every run of
the round then sends `--num-requests` Poisson arrivals at `--load` (0.5) of it. The capacity is
measured per round because the machine these runs were made on is shared and its speed moves:
in one session a burst read 10.9 requests/s (bench_queueing's 75% rule) and the server then
saturated at about 5.5; four minutes later a burst read 0.45 by that rule. `--capacity` gives
it instead (the rate is then the same in every round).
Per round, each lora mode (`--modes`) in each layout serves the same trace under each assignment
(`--assignments`: identical, zipf:1.0, distinct; the arrivals, lengths and prompts are the same
under all three, only the adapters differ), each run on a fresh server; the order of the runs
alternates between rounds. `cached` is not among the modes: it pins every adapter a server
registers, and 1,024 adapters do not fit in a room for 8 (the config records both sizes). The
mode `all-cached` is a control instead: `cached` with every adapter its trace names registered
at start-up (`--lora`) and a room for all of them, so that no adapter is ever cold and a
distinct request costs only what serving many different adapters at once costs (their rows read
every step, their ranks). Its distinct / identical is what no paging can remove; the default
mode's distinct over its distinct (`p99_ttft_ratio_distinct_vs_all_cached_distinct`) is what
being cold costs. Pooled over rounds per mode and assignment: P99 TTFT (to the first streamed token;
`ttft_text_p99_ms` to the first text, scripts/loadgen/client.py), throughput, failures and refusals
(429 / 503 / 507 answers: no room for a request or an adapter); the headline ratios distinct /
identical and zipf / identical, per mode, layout and round (the spread), at top level for the
default mode in the default layout (the first of `--layouts` when that is not run). Each run also
records the server's adapter-cache and resolver counters, the share of its span the engine's steps
took (`engine_busy_fraction`: not the load, since a decode step costs nearly the same for one
request as for eight; at half of a burst's rate it was 0.84-0.89, at a quarter 0.77) and the share
of the machine other processes used while it ran.

    python -m bench.bench_adapter_scale [--rounds 2 --num-requests 400]
    python -m bench.bench_adapter_scale --quick --out /tmp/adapter_scale_quick.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from bench.bench_single_server import OtherCpu
from bench.common import adapter_bytes, free_port, write_random_adapter
from bench.envelope import describe_device, write_result
from bench.queueing_configs import burst_capacity
from toppings.scripts.children import start, stop, wait_healthy
from toppings.scripts.loadgen.cli import list_models
from toppings.scripts.loadgen.client import run_open_loop
from toppings.scripts.loadgen.stats import percentile, summarise
from toppings.scripts.loadgen.workload import (
    LengthSpec,
    TraceEntry,
    WorkloadSpec,
    build_trace,
    parse_assignment,
)
from toppings.server.config import LoraConfig, MemoryConfig
from toppings.server.lora_modes import pick_mode
from toppings.server.model.loader import load_checkpoint, resolve_model_dir

log = logging.getLogger("bench_adapter_scale")
RANKS = (8, 16, 32, 64)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ASSIGNMENTS = ("identical", "zipf:1.0", "distinct")
DEFAULT_MODE = pick_mode(LoraConfig().lora_mode, "cpu")  # what the servers here run by default
LAYOUTS = ("static", "pool")
DEFAULT_LAYOUT = MemoryConfig().memory_layout
REFUSED = (429, 503, 507)  # no room now: for requests, for a resolution, for host bytes
# --adapters registered: host bytes the server may hold them in (1,024 adapters of ranks 8-64 on
# q, k, v, o of SmolLM2 are charged about 7 GB at a bfloat16 server's bfloat16, 14 at float32;
# the default is a quarter of the memory)
REGISTERED_HOST_BYTES = 16 * 2**30
ALL_CACHED = "all-cached"  # the control mode (module docstring)
QUICK = {"num_adapters": 16, "slots": 3, "num_requests": 8, "rounds": 1, "burst": 4,
         "max_prompt_len": 48, "max_output_len": 8}  # fmt: skip
SERIES = ("adapter_cache_hits", "adapter_cache_misses", "adapter_loads", "adapter_evictions",
          "cpu_lora_invocations", "lora_resolutions", "lora_resolution_seconds_sum",
          "lora_resolution_seconds_count", "lora_resolver_evictions",
          "lora_resolver_host_hits", "lora_resolver_wait_seconds_count",
          "lora_resolver_wait_seconds_sum", "requests_host_served", "requests_host_promoted",
          "prefill_steps", "prefill_seconds", "decode_steps", "decode_seconds",
          "prefix_cache_hit_tokens", "prefix_cache_prompt_tokens")  # fmt: skip


def adapter_names(num: int) -> dict[str, int]:
    """name -> rank of `num` adapters, ranks in turn."""
    return {f"a{i:04d}-r{RANKS[i % len(RANKS)]}": RANKS[i % len(RANKS)] for i in range(num)}


def make_adapters(root: Path, model_dir: str, num: int) -> dict[str, int]:
    """The adapters of `adapter_names(num)` under `root`, each written once with its own seed."""
    ranks = adapter_names(num)
    missing = [n for n in ranks if not (root / n / "adapter_model.safetensors").is_file()]
    if missing:
        config = load_checkpoint(model_dir, "dummy").config  # shapes only
        log.info("writing %d adapters under %s", len(missing), root)
        for name in missing:
            seed = int(name[1:5])
            write_random_adapter(root / name, model_dir, ranks[name], TARGETS, seed, config)
    return ranks


def server_series(url: str) -> dict[str, float]:
    """The adapter cache, CPU LoRA and resolver series of a server's /metrics (resolutions
    by outcome as `lora_resolutions_<outcome>`, waits by bound as `..._<bound>`)."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url + "/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix("toppings:").removesuffix("_total")
            if name == "lora_resolutions":
                values[f"{name}_{sample.labels['outcome']}"] = sample.value
            elif name in SERIES and "bound" in sample.labels:
                values[f"{name}_{sample.labels['bound']}"] = sample.value
            elif name in SERIES:
                values[name] = sample.value
    return values


class Server:
    """One toppings-serve of the bench, started on enter and stopped on exit."""

    def __init__(self, args, mode: str, layout: str, room_bytes: int, log_path: Path, names=()):
        """mode: a lora mode, or ALL_CACHED (cached, the adapters `names` registered at
        start-up; room_bytes is then the room for them all); layout: a --memory-layout."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        if mode == ALL_CACHED:
            found = [f"--lora={n}={args.adapter_dir / n}" for n in sorted(names)]
            mode = "cached"
        elif args.adapters == "registered":  # every adapter in host memory from the start
            found = ["--lora-dir", str(args.adapter_dir), "--adapter-host-bytes",
                     str(REGISTERED_HOST_BYTES)]  # fmt: skip
        else:
            found = ["--lora-resolver", f"dir:{args.adapter_dir}"]
        self.argv = ["--model", args.model, "--dtype", args.dtype, "--lora-mode", mode,
                     *found, "--memory-layout", layout,
                     "--adapter-cache-bytes", str(room_bytes), "--max-total-tokens",
                     str(args.max_total_tokens), "--port", str(self.port),
                     "--torch-threads", str(args.torch_threads)]  # fmt: skip

    def __enter__(self) -> Server:
        self.proc = start("toppings.server.cli", self.argv, self.log_path)
        try:
            wait_healthy(self.url, self.proc, self.log_path, 1800.0)
            base, _ = list_models(self.url)
            warm = [TraceEntry(-1, 0.0, base, 0, list(range(100, 132)), 4)]
            run_open_loop(self.url, warm, lambda e, r: None)  # first-touch costs out
        except BaseException:
            stop([self.proc])
            raise
        return self

    def __exit__(self, *exc) -> None:
        stop([self.proc])

    def replay(self, trace: list[TraceEntry]) -> list[dict]:
        records: list[dict] = []
        run_open_loop(
            self.url, trace, lambda e, r: records.append({"config": {"idx": e.idx}, "result": r})
        )
        return records


def workload(args, assignment: str, ranks: dict[str, int], rps: float, seed: int, num: int):
    popularity, alpha = parse_assignment(assignment)
    spec = WorkloadSpec(
        rps=rps,
        num_requests=num,
        popularity=popularity,
        alpha=alpha,
        prompt_len=LengthSpec.parse(args.prompt_len, args.max_prompt_len, "prompt"),
        output_len=LengthSpec.parse(args.output_len, args.max_output_len, "output"),
        seed=seed,
    )
    return build_trace(spec, ranks)


def measure_capacity(
    args, ranks: dict[str, int], layout: str, room: int, log_path: Path
) -> tuple[dict, str]:
    """Capacity (requests/s) of the default mode's server in `layout` for one warm adapter, from
    a burst:
    `requests_per_s`, all its requests over the time the last one took; and, beside it,
    `burst_rule_rps`, bench_queueing's rule (75% of them over the time the 75th percent took),
    which the short requests of a lognormal length mix finish first: here it read twice the
    rate at which the server saturated, so the runs are sized on the first. Then, on the same
    server, the same requests for as many distinct adapters it has not met
    (`distinct_requests_per_s`, measured alike): what a burst of cold adapters gets, which the
    runs do not size on (every assignment runs at the same rate)."""
    burst = workload(args, "identical", ranks, 1.0, 998, args.burst)
    burst = [TraceEntry(e.idx, 0.0, e.model, e.rank, e.prompt, e.max_tokens) for e in burst]
    others = [e for e in workload(args, "distinct", ranks, 1.0, 998, 2 * args.burst)
              if e.model != burst[0].model][: args.burst]  # fmt: skip
    cold = [TraceEntry(e.idx, 0.0, d.model, d.rank, e.prompt, e.max_tokens)
            for e, d in zip(burst, others, strict=True)]  # fmt: skip
    with Server(args, DEFAULT_MODE, layout, room, log_path) as server:
        server.replay(burst[:1])  # resolve and load the adapter: a warm burst
        records = server.replay(burst)
        cold_records = server.replay(cold)
    done, cold_done = burst_e2e(records), burst_e2e(cold_records)
    capacity = {"requests_per_s": len(done) / max(done), "burst_rule_rps": burst_capacity(done),
                "distinct_requests_per_s": len(cold_done) / max(cold_done)}  # fmt: skip
    return capacity, burst[0].model


def burst_e2e(records: list[dict]) -> list[float]:
    """Each request's end-to-end seconds in a capacity burst; SystemExit when any failed."""
    done = [r["result"]["e2e_s"] for r in records if r["result"]["ok"]]
    if len(done) < len(records):
        errors = {str(r["result"]["error"])[:200] for r in records if not r["result"]["ok"]}
        raise SystemExit(f"capacity burst: {len(records) - len(done)} requests failed: {errors}")
    return done


def run_summary(records: list[dict], series: dict, other_cpu: float) -> dict:
    summary = summarise(records)
    statuses = [r["result"].get("status") for r in records if not r["result"]["ok"]]
    summary["num_refused"] = sum(s in REFUSED for s in statuses)
    summary["errors"] = sorted({str(r["result"]["error"])[:160] for r in records
                                if not r["result"]["ok"]})[:5]  # fmt: skip
    summary["server"] = series
    if summary.get("span_s"):  # the share of the run a step ran: not the load of a batching engine
        busy = series.get("prefill_seconds", 0.0) + series.get("decode_seconds", 0.0)
        summary["engine_busy_fraction"] = busy / summary["span_s"]
    summary["other_processes_cpu_share"] = other_cpu
    return summary


def pooled(runs: list[tuple[list[dict], dict]]) -> dict:
    """One mode and assignment over rounds: pooled P99 TTFT, per-round spread, throughput."""
    records = [r for recs, _ in runs for r in recs]
    ok = [r["result"] for r in records if r["result"]["ok"]]
    return {
        "num_requests": len(records),
        "num_failed": len(records) - len(ok),
        "num_refused": sum(s["num_refused"] for _, s in runs),
        "ttft_p50_ms": percentile([1000 * r["ttft_s"] for r in ok], 50),
        "ttft_p99_ms": percentile([1000 * r["ttft_s"] for r in ok], 99),
        "ttft_p99_ms_per_round": [s["ttft_p99_ms"] for _, s in runs],
        # to the first event with text (what TTFT was before every token got its event)
        "ttft_text_p99_ms": percentile(
            [1000 * r["ttft_text_s"] for r in ok if r.get("ttft_text_s") is not None], 99
        ),
        "output_tokens_per_s_per_round": [s.get("output_tokens_per_s") for _, s in runs],
        "output_tokens_per_s": sum(s.get("output_tokens_per_s", 0.0) for _, s in runs) / len(runs),
        "requests_per_s": sum(s.get("requests_per_s", 0.0) for _, s in runs) / len(runs),
        "runs": [s for _, s in runs],
    }


def ratios(per_assignment: dict[str, dict]) -> dict:
    """The headline ratios of one mode, pooled and per round."""
    ident = per_assignment.get("identical")
    out: dict = {}
    if ident is None:
        return out
    for name, key in (("distinct", "distinct"), ("zipf", "zipf:1.0")):
        other = per_assignment.get(key)
        if other is None:
            continue
        out[f"p99_ttft_ratio_{name}_vs_identical"] = other["ttft_p99_ms"] / ident["ttft_p99_ms"]
        out[f"p99_ttft_ratio_{name}_vs_identical_per_round"] = [
            a / b for a, b in zip(other["ttft_p99_ms_per_round"], ident["ttft_p99_ms_per_round"])
        ]
        out[f"p99_ttft_text_ratio_{name}_vs_identical"] = (
            other["ttft_text_p99_ms"] / ident["ttft_text_p99_ms"]
        )
        out[f"throughput_ratio_{name}_vs_identical"] = (
            other["output_tokens_per_s"] / ident["output_tokens_per_s"]
        )
    return out


def headline_metrics(
    per_run: dict[tuple[str, str], dict], by_run: dict[tuple[str, str], dict], layout: str
) -> dict:
    """The top-level metrics: the default mode's ratios in `layout` (`by_run`: each mode and
    layout's `ratios`), being cold's cost there (over all-cached, when run), and refusals and
    failures over every run."""
    metrics: dict = dict(by_run.get((DEFAULT_MODE, layout), {}))
    default = per_run.get((DEFAULT_MODE, layout))
    control = per_run.get((ALL_CACHED, layout))
    if default is not None and control is not None and "distinct" in default:
        cold, warm = default["distinct"], control.get("distinct")
        if warm is not None:
            metrics["p99_ttft_ratio_distinct_vs_all_cached_distinct"] = (
                cold["ttft_p99_ms"] / warm["ttft_p99_ms"]
            )
            metrics["p99_ttft_ratio_distinct_vs_all_cached_distinct_per_round"] = [
                a / b for a, b in zip(cold["ttft_p99_ms_per_round"], warm["ttft_p99_ms_per_round"])
            ]
    metrics["num_refused"] = sum(p["num_refused"] for r in per_run.values() for p in r.values())
    metrics["num_failed"] = sum(p["num_failed"] for r in per_run.values() for p in r.values())
    return metrics


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="served model (smollm2 or a directory)")
    p.add_argument("--dtype", default="bfloat16", help="the servers' --dtype")
    p.add_argument("--num-adapters", type=int, default=1024)
    p.add_argument("--slots", type=int, default=8, help="device room, in mean adapters")
    p.add_argument("--modes", default="on-demand,cpu-assisted",
                   help=f"lora modes, and {ALL_CACHED} (a control: module docstring)")  # fmt: skip
    p.add_argument("--assignments", default=",".join(ASSIGNMENTS))
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="the servers' --memory-layout")
    p.add_argument("--load", type=float, default=0.5, help="fraction of the measured capacity")
    p.add_argument(
        "--capacity",
        type=float,
        help="the capacity (requests/s) to take --load of, instead of measuring it each round",
    )
    p.add_argument("--num-requests", type=int, default=400, help="requests per run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--burst", type=int, default=32, help="requests of the capacity burst")
    p.add_argument("--prompt-len", default="lmsys")
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--output-len", default="lognormal:32:1.0")
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="the servers' --torch-threads (0: their default, every core); 1 on a host whose "
        "cores other processes use, where OpenMP's barriers wait on them",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--adapter-dir",
        type=Path,
        default=Path.home() / ".cache/toppings/bench_adapters/smollm2-qkvo-1024",
    )
    p.add_argument(
        "--adapters",
        choices=("resolver", "registered"),
        default="resolver",
        help="how the servers find the adapters: on first use from --adapter-dir (the resolver; "
        "a cold adapter is read from disk), or all registered at start-up (--lora-dir: every "
        "adapter in host memory, as Toppings keeps them; a cold adapter only loads to the "
        "device)",
    )
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: {json.dumps(QUICK)}")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench/results/adapter_scale.json"))
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    began = time.monotonic()
    load_start = os.getloadavg()[0]
    modes, layouts = args.modes.split(","), args.layouts.split(",")
    assignments = args.assignments.split(",")
    for a in assignments:
        parse_assignment(a)  # a bad one fails before anything slow
    if not set(layouts) <= set(LAYOUTS):
        raise SystemExit(f"--layouts: each of {', '.join(LAYOUTS)}, not {args.layouts}")
    headline = DEFAULT_LAYOUT if DEFAULT_LAYOUT in layouts else layouts[0]
    model_dir = str(resolve_model_dir(args.model))
    ranks = make_adapters(args.adapter_dir, model_dir, args.num_adapters)
    dtype = getattr(torch, args.dtype)
    nbytes = {r: adapter_bytes(args.adapter_dir / next(n for n in ranks if ranks[n] == r),
                               model_dir, dtype) for r in RANKS}  # fmt: skip
    mean_bytes = sum(nbytes[r] for r in ranks.values()) / len(ranks)
    room = int(args.slots * mean_bytes)
    logs = Path(tempfile.mkdtemp(prefix="bench-adapter-scale-"))
    runs = {(m, lay): {a: [] for a in assignments} for m in modes for lay in layouts}
    order = [(m, lay, a) for a in assignments for lay in layouts for m in modes]
    capacities, rates = [], []
    for rnd in range(args.rounds):
        if args.capacity is None:
            capacity, warm = measure_capacity(args, ranks, headline, room,
                                              logs / f"r{rnd}-capacity.log")  # fmt: skip
            capacities.append({**capacity, "adapter": warm})
        else:
            capacities.append({"requests_per_s": args.capacity, "given": True})
        rps = args.load * capacities[-1]["requests_per_s"]
        rates.append(rps)
        log.info("round %d: %s; runs at %.2f requests/s; room %d bytes", rnd, capacities[-1],
                 rps, room)  # fmt: skip
        for mode, layout, assignment in order if rnd % 2 == 0 else order[::-1]:
            trace = workload(args, assignment, ranks, rps, args.seed + rnd, args.num_requests)
            name = f"r{rnd}-{mode}-{layout}-{assignment.replace(':', '')}"
            names = {e.model for e in trace}
            mode_room = room
            if mode == ALL_CACHED:  # room for every adapter of the trace, the pool's alignment too
                mode_room = int(1.25 * sum(nbytes[ranks[n]] for n in names))
            with Server(args, mode, layout, mode_room, logs / f"{name}.log", names) as server:
                with OtherCpu() as other:
                    records = server.replay(trace)
                series = server_series(server.url)
            summary = run_summary(records, series, other.share)
            runs[mode, layout][assignment].append((records, summary))
            log.info("%s: P99 TTFT %.0f ms, %.1f tok/s, %d failed (%d refused); %s", name,
                     summary["ttft_p99_ms"], summary.get("output_tokens_per_s", 0.0),
                     summary["num_failed"], summary["num_refused"], series)  # fmt: skip
    per_run = {key: {a: pooled(r[a]) for a in assignments} for key, r in runs.items()}
    by_run = {key: ratios(p) for key, p in per_run.items()}
    metrics = headline_metrics(per_run, by_run, headline)
    metrics["layout"] = headline
    metrics["modes"] = {m: {**by_run[m, headline], "layouts": {
        lay: {**by_run[m, lay], "assignments": per_run[m, lay]} for lay in layouts}}
        for m in modes}  # fmt: skip
    total_bytes = sum(nbytes[r] for r in ranks.values())
    config = {
        **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "default_lora_mode": DEFAULT_MODE,
        "ranks": list(RANKS),
        "targets": list(TARGETS),
        "adapter_bytes_per_rank": {str(r): b for r, b in nbytes.items()},
        "adapter_room_bytes": room,
        "all_adapters_bytes": total_bytes,
        "cached_mode": f"not run: it pins every adapter a server registers, and the "
        f"{len(ranks)} adapters ({total_bytes / 1e6:.0f} MB) do not fit the room for "
        f"{args.slots} ({room / 1e6:.1f} MB)",
        "registration": "--lora-dir ADAPTER_DIR (all registered at start-up)"
        if args.adapters == "registered"
        else "--lora-resolver dir:ADAPTER_DIR (found on first use)",
        "memory_layout": "per --layouts; the room is --adapter-cache-bytes in either (module "
        "docstring)",
        "capacity_per_round": capacities,
        "capacity_rule": "a burst of --burst requests for one warm adapter on the default mode's "
        "server at the start of each round: all of them over the time the last took "
        "(burst_rule_rps beside it; distinct_requests_per_s: the same requests for as many cold "
        "adapters, alike, not used to size the runs)",
        "rps_per_round": rates,
        "run_order": "per round, for each assignment each layout, for each layout each mode; odd "
        "rounds reversed",
        "load_average_1min_at_start_and_end": [load_start, os.getloadavg()[0]],
        "wall_s": time.monotonic() - began,
        "server_logs": str(logs),
    }
    result = write_result(args.out, "adapter_scale", "bench_adapter_scale",
                          device=describe_device(), argv=argv, config=config,
                          metrics=metrics)  # fmt: skip
    headline = {k: v for k, v in metrics.items() if k != "modes"}
    print(json.dumps(headline, indent=2))
    return result


if __name__ == "__main__":
    main()
