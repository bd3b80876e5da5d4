"""A small real cluster: 3 loopback SmolLM2 servers, loraserve against rank-aware, one trace.

    python -m bench.bench_cluster_real [--rps 0.4] [--duration 90] [--output-len 24]

Six random adapters (ranks 8, 8, 16, 32, 64, 64, q/k/v) of SmolLM2-135M-Instruct. rank-aware
runs as Toppings does: every server holds every adapter. loraserve starts each server with two
adapters of its own (disjoint) and an --adapter-store; placement steps every 10 s move adapters
between servers by peer fetch. The scheduler routes on the perf model fitted here
(bench/results/perf_model_smollm2_cpu.json) with its default SLO; toppings-loadgen sends the
same Zipf trace (saved by the first run, replayed by the second) and measures SLO attainment
(time per token) and TTFT. Writes bench/results/cluster_real.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import requests

from bench.common import free_port
from bench.envelope import write_result
from toppings.scripts.loadgen.stats import summarise
from toppings.server.api.admin.files import adapter_digest

log = logging.getLogger("bench_cluster_real")
RANKS = (8, 8, 16, 32, 64, 64)
PERF = Path("bench/results/perf_model_smollm2_cpu.json")
KEYS = ("slo_attainment", "ttft_p50_ms", "ttft_p99_ms", "tpt_p50_ms", "tpt_p99_ms", "num_ok")


def wait(url: str, ok=(200,), timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if requests.get(url, timeout=5).status_code in ok:
                return
        except requests.ConnectionError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up")
        time.sleep(0.5)


def run_policy(policy: str, model: Path, adapters: dict, root: Path, args) -> dict:
    """Start 3 servers and a scheduler, run the load, stop them; the load's summary."""
    procs = []
    work = root / policy
    work.mkdir()
    try:
        servers = []
        names = sorted(adapters)
        ports = [free_port() for _ in range(3)]
        for i, port in enumerate(ports):
            mine = names if policy == "rank-aware" else names[2 * i : 2 * i + 2]
            cmd = [sys.executable, "-m", "toppings.server.cli", "--model", str(model),
                   "--port", str(port), "--device", "cpu", "--dtype", "float32",
                   "--adapter-store", str(work / f"store{i}")]  # fmt: skip
            cmd += [a for p in ports for a in ("--peer", f"http://127.0.0.1:{p}")]
            cmd += [a for n in mine for a in ("--lora", f"{n}={adapters[n]}")]
            log_file = (work / f"server{i}.log").open("w")
            procs.append(subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT))
            servers.append(f"http://127.0.0.1:{port}")
        port = free_port()
        scheduler = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "toppings.scheduler.cli", "--registry",
               str(work / "reg.sqlite"), "--port", str(port), "--perf-model", str(PERF),
               "--policy", policy, "--placement-interval-s", "10"]  # fmt: skip
        log_file = (work / "scheduler.log").open("w")
        procs.append(subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT))
        for url in servers:
            wait(url + "/health")
        wait(scheduler + "/health", ok=(200, 503))
        for url in servers:
            requests.post(scheduler + "/admin/servers", json={"url": url}, timeout=60)
        models = requests.get(scheduler + "/v1/models", timeout=10).json()["data"]
        base = next(m["id"] for m in models if m["parent"] is None)
        for name, path in adapters.items():
            body = {"name": name, "base_model": base, "rank": int(name.split("-")[1][1:]),
                    "path": str(path), "sha256": adapter_digest(path)}  # fmt: skip
            requests.post(scheduler + "/admin/adapters", json=body, timeout=60).raise_for_status()
        slo = requests.get(scheduler + "/admin/state", timeout=10).json()["slo_tpt_ms"]
        trace = root / "trace.jsonl"
        cmd = [sys.executable, "-m", "toppings.scripts.loadgen.cli", "--url", scheduler,
               "--out", str(work / "records.jsonl"), "--slo-tpt-ms", str(slo),
               "--no-progress", "--timeout", "600"]  # fmt: skip
        if trace.exists():
            cmd += ["--trace", str(trace)]
        else:
            cmd += ["--rps", str(args.rps), "--duration", str(args.duration), "--popularity",
                    "zipf", "--alpha", "1.1", "--prompt-len", "lognormal:64:0.8",
                    "--output-len", str(args.output_len), "--seed", "0",
                    "--save-trace", str(trace)]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in (work / "records.jsonl").open()]
        summary = summarise(records, slo)
        state = requests.get(scheduler + "/admin/state", timeout=10).json()
        held = {s["url"]: s["adapters"] for s in state["servers"]}
        return {"summary": summary, "slo_tpt_ms": slo, "placement": state.get("placement"),
                "adapters_held_at_end": held}  # fmt: skip
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rps", type=float, default=0.4)
    parser.add_argument("--duration", type=float, default=90.0)
    parser.add_argument("--output-len", type=int, default=24)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/toppings_cluster_real"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/cluster_real.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from toppings.scripts.make_adapters import make_random_adapter
    from toppings.server.model.loader import resolve_model_dir

    model = resolve_model_dir("smollm2")
    root = args.workdir
    if root.exists():
        raise SystemExit(f"{root} exists: remove it or pass another --workdir")
    adapters = {}
    for i, rank in enumerate(RANKS):
        name = f"lora-r{rank}-{i}"
        adapters[name] = make_random_adapter(root / "adapters" / name, model, rank=rank, seed=i)
    results = {}
    for policy in ("rank-aware", "loraserve"):
        log.info("running %s", policy)
        results[policy] = run_policy(policy, model, adapters, root, args)
    ours, theirs = results["loraserve"]["summary"], results["rank-aware"]["summary"]
    write_result(
        args.out, "cluster_real", "bench_cluster_real", argv=argv,
        device=f"cpu, 3 servers and the scheduler on one {os.cpu_count()}-core machine",
        config={"model": "SmolLM2-135M-Instruct float32", "ranks": RANKS, "rps": args.rps,
                "duration_s": args.duration, "output_len": args.output_len,
                "trace": "toppings-loadgen Zipf 1.1, saved by the first run, replayed",
                "rank_aware": "every server holds every adapter",
                "loraserve": "each server starts with 2 adapters; placement every 10 s"},
        metrics={"side_by_side": {p: {k: r["summary"].get(k) for k in KEYS}
                                  for p, r in results.items()},
                 "ttft_p50_ratio_loraserve_vs_rank_aware":
                     ours["ttft_p50_ms"] / theirs["ttft_p50_ms"],
                 "runs": results},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
