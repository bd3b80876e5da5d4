"""The paper's single-server experiment (shape of Toppings Tab. 2) scaled to a small CPU machine.

Many random adapters (ranks 32 and 64, targets q, k, v) on SmolLM2-135M; one Poisson trace with a
rank mix and LMSYS-shaped lengths; the same trace replayed, one after the other, against
- `toppings-serve --lora-mode cached` (every adapter preloaded: the ideal),
- `--lora-mode on-demand` and `--lora-mode cpu-assisted`, whose adapter cache holds a quarter of
  the adapters' bytes (LRU), so that many requests need a load; the load is a real copy throttled
  to an emulated link on which one rank-64 adapter takes as long as one 128-token prefill (as
  bench/bench_cpu_assisted.py sets it),
- transformers + PEFT in-process (bench.hf_peft_peer: static batches of `generate`).
Each server is a separate process started here and driven over HTTP by the load generator's own
sender (toppings.scripts.loadgen.client). Writes bench/results/single_server.json and CDF plots.

    python -m bench.bench_single_server [--rps 1.0 --duration 120 --num-adapters 200]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.common import adapter_bytes, link_gbps_for, prefill_ms
from bench.envelope import describe_device, write_result
from toppings.scripts.children import start, stop, wait_healthy
from toppings.scripts.loadgen.cli import list_models
from toppings.scripts.loadgen.client import run_open_loop
from toppings.scripts.loadgen.stats import plot_cdfs, summarise
from toppings.scripts.loadgen.workload import LengthSpec, TraceEntry, WorkloadSpec, build_trace
from toppings.scripts.make_adapters import make_random_adapter
from toppings.server.model.loader import resolve_model_dir

log = logging.getLogger("bench_single_server")
MODES = ("cached", "on-demand", "cpu-assisted")
TARGETS = ("q_proj", "k_proj", "v_proj")
COUNTERS = ("adapter_cache_hits", "adapter_cache_misses", "adapter_loads", "adapter_evictions",
            "cpu_lora_invocations")  # fmt: skip
QUIET_LOAD = 1.5  # load average under which the machine counts as quiet at the start
QUIET_SHARE = 0.1  # share of all cores that other processes may use during a quiet run


class OtherCpu:
    """CPU used by processes other than this one and its waited-for children, over a span.

    Busy time of the whole machine (/proc/stat) minus our own (os.times, children included once
    they are waited for), as a share of all cores over the wall time.
    """

    def __enter__(self) -> OtherCpu:
        self.start = (self._busy_s(), self._own_s(), time.monotonic())
        return self

    def __exit__(self, *exc) -> None:
        busy, own, wall = (
            b - a for a, b in zip(self.start, (self._busy_s(), self._own_s(), time.monotonic()))
        )
        self.share = max(0.0, busy - own) / (wall * (os.cpu_count() or 1))

    @staticmethod
    def _busy_s() -> float:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(
                int, f.readline().split()[1:9]
            )
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_s() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system


def make_adapters(root: Path, model_dir: Path, num: int, num_distinct: int = 20) -> dict[str, int]:
    """`num` adapters under `root`, alternately rank 64 and 32; returns name -> rank.

    The first `num_distinct` are made with make_random_adapter; the others are file copies of
    them under their own names (the servers load and cache every name separately, and their
    speed does not depend on the values), which saves minutes of CPU per adapter here.
    """
    from toppings.scripts.make_adapters import load_base

    ranks = {f"r{64 if i % 2 == 0 else 32}-{i:03d}": 64 if i % 2 == 0 else 32 for i in range(num)}
    names = list(ranks)
    base = None
    for i, name in enumerate(names):
        if (root / name / "adapter_model.safetensors").is_file():
            continue
        if i < num_distinct:
            base = base or load_base(model_dir)
            make_random_adapter(
                root / name, base, rank=ranks[name], target_modules=TARGETS, seed=1000 + i
            )
        else:
            shutil.copytree(root / names[i % num_distinct], root / name)
    return ranks


def server_counters(url: str) -> dict[str, float]:
    """The adapter cache and CPU LoRA counters of a server, from its /metrics."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url + "/metrics", timeout=10).text
    values = {
        sample.name.removeprefix("toppings:").removesuffix("_total"): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    return {name: values[name] for name in COUNTERS if name in values}


def run_server(mode: str, args, root: Path, trace, link_gbps: float, cache_bytes: int, logs: Path):
    """Start one toppings-serve, replay the trace against it, stop it.

    Returns (records, the server's cache counters after the trace, warm-up request included).
    """
    serve = [
        "--model",
        "smollm2",
        "--lora-dir",
        str(root),
        "--lora-mode",
        mode,
        "--port",
        str(args.port),
        "--max-total-tokens",
        str(args.max_total_tokens),
    ]
    if mode != "cached":
        serve += ["--link-gbps", str(link_gbps), "--adapter-cache-bytes", str(cache_bytes)]
    proc = start("toppings.server.cli", serve, logs / f"{mode}.log")
    records: list[dict] = []
    counters: dict[str, float] = {}
    try:
        url = f"http://127.0.0.1:{args.port}"
        wait_healthy(url, proc, logs / f"{mode}.log", 900.0)
        base, _ = list_models(url)
        warm = [TraceEntry(-1, 0.0, base, 0, list(range(100, 164)), 8)]
        run_open_loop(url, warm, lambda e, r: None)  # first-touch costs out of the measurement
        run_open_loop(
            url, trace, lambda e, r: records.append({"config": {"idx": e.idx}, "result": r})
        )
        counters = server_counters(url)
        log.info("%s: %s %s", mode, json.dumps(summarise(records)), counters)
    finally:
        stop([proc])
    return records, counters


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rps", type=float, default=1.0)
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--num-adapters", type=int, default=200)
    p.add_argument("--popularity", default="zipf")
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--prompt-len", default="lmsys")
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--output-len", default="lognormal:32:1.0")
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--cache-fraction", type=float, default=0.25)
    p.add_argument("--hf-max-batch", type=int, default=32)
    p.add_argument("--port", type=int, default=18200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default="cached,on-demand,cpu-assisted,hf-peft")
    p.add_argument("--adapter-dir", type=Path, default=Path("/tmp/toppings-single-server-adapters"))
    p.add_argument("--out", type=Path, default=Path("bench/results/single_server.json"))
    p.add_argument("--plot", type=Path, default=Path("bench/single_server_cdf.png"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    systems = args.systems.split(",")
    model_dir = str(resolve_model_dir("smollm2"))
    ranks = make_adapters(args.adapter_dir, Path(model_dir), args.num_adapters)
    spec = WorkloadSpec(
        rps=args.rps,
        duration_s=args.duration,
        popularity=args.popularity,
        alpha=args.alpha,
        rank_mix=((32, 1.0), (64, 1.0)),
        seed=args.seed,
        prompt_len=LengthSpec.parse(args.prompt_len, args.max_prompt_len, "prompt"),
        output_len=LengthSpec.parse(args.output_len, args.max_output_len, "output"),
    )
    trace = build_trace(spec, ranks)
    nbytes = {
        r: adapter_bytes(
            args.adapter_dir / next(n for n in ranks if ranks[n] == r), model_dir, torch.float32
        )
        for r in (32, 64)
    }
    base_prefill_ms = prefill_ms(model_dir, "float32", list(range(100, 228)))
    link_gbps = link_gbps_for(nbytes[64], base_prefill_ms / 1000)
    cache_bytes = int(args.cache_fraction * sum(nbytes[r] for r in ranks.values()))
    load_start = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {}
    counters: dict[str, dict] = {}
    loads: dict[str, float] = {}
    logs = Path(tempfile.mkdtemp(prefix="bench-single-"))
    for mode in (m for m in MODES if m in systems):
        with OtherCpu() as other:
            runs[mode], counters[mode] = run_server(
                mode, args, args.adapter_dir, trace, link_gbps, cache_bytes, logs
            )
        loads[mode] = other.share
    if "hf-peft" in systems:
        from bench.hf_peft_peer import load_peft_model, replay

        used = sorted({e.model for e in trace})
        model = load_peft_model(model_dir, {n: str(args.adapter_dir / n) for n in used})
        with OtherCpu() as other:
            runs["hf-peft"] = replay(model, trace, args.hf_max_batch)
        loads["hf-peft"] = other.share
        del model
    write_results(
        args, argv, trace, runs, counters, loads, load_start, link_gbps, cache_bytes,
        base_prefill_ms, logs,
    )  # fmt: skip


def write_results(
    args, argv, trace, runs, counters, loads, load_start, link_gbps, cache_bytes,
    base_prefill_ms, logs,
) -> None:  # fmt: skip
    summaries = {name: summarise(records) for name, records in runs.items()}
    ratios = {}
    if "cached" in summaries:
        c = summaries["cached"]
        for name, s in summaries.items():
            ratios[name] = {
                f"{k}_ratio_vs_cached": s[f"{k}_mean_ms"] / c[f"{k}_mean_ms"]
                for k in ("ttft", "tpt", "e2e")
            }
    quiet = load_start < QUIET_LOAD and all(v < QUIET_SHARE for v in loads.values())
    result = write_result(
        args.out,
        "single_server",
        "bench_single_server",
        device=f"{describe_device()}, emulated link",
        argv=argv,
        config={
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "model": "SmolLM2-135M-Instruct (float32)",
            "num_requests": len(trace),
            "mean_prompt_tokens": sum(len(e.prompt) for e in trace) / len(trace),
            "mean_output_tokens": sum(e.max_tokens for e in trace) / len(trace),
            "num_adapters_used": len({e.model for e in trace}),
            "link_gbps": link_gbps,
            "link": "emulated: one rank-64 adapter load = one 128-token prefill "
            f"({base_prefill_ms:.1f} ms)",
            "adapter_cache_bytes": cache_bytes,
            "load_average_at_start": load_start,
            "other_processes_cpu_share_per_run": loads,
            "quiet_machine": quiet,
            "server_logs": str(logs),
        },
        metrics={"systems": summaries, "ratios": ratios, "server_counters": counters},
    )
    title = f"SmolLM2 CPU, {len(trace)} requests, Poisson {args.rps} rps, emulated link"
    plot_cdfs(runs, str(args.plot), title, log_x=True)
    records = args.out.with_name(args.out.stem + "_records.jsonl")
    with open(records, "w") as f:
        for name, recs in runs.items():
            for r in recs:
                f.write(json.dumps({"system": name, **r}) + "\n")
    print(json.dumps(result["metrics"], indent=2))


if __name__ == "__main__":
    main()
