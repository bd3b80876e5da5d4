"""TTFT and time per token of cached / on-demand / cpu-assisted when requests need adapter loads.

Requests arrive as a Poisson stream at `--load` (default half) of this machine's capacity,
measured first (`cached`, every request submitted at once: requests per second). Each asks for
one of `--num-adapters` adapters of ranks `--ranks` (8-128, in turn), picked at random; in
on-demand and cpu-assisted the device holds only `--cache-share` of their bytes (at least two
of the largest), so most requests need a load; `cached` preloads them all (the ideal upper
bound). Every mode runs `--rounds` times in alternating order, the same arrivals for every mode
of a round; the ratios are taken per round and reported as the median with the spread across
rounds.

The shape (default): Llama-2-7B's layers (hidden 4096, intermediate 11008, 32 heads; the
Toppings paper's model) with `--layers 4` instead of 32, random weights from `--load-format
dummy` (scripts/make_dummy_model.py, presets llama-2-7b, llama-3.2-1b, qwen2.5-1.5b). Fewer
layers keep both sides of the comparison in proportion: an adapter's load and a prefill each
cost the same per layer (a layer group's copy vs the layer's forward), so their ratio, which
decides how much of a load cpu-assisted can hide, is the 32-layer model's; only the embedding
and the LM head (one row per prompt) do not scale, and they are small beside 4 layers of 7B.

The link (on a CPU): by default its bandwidth is set so that loading a rank-64 adapter takes
`--load-to-prefill` (1.0) times one prefill of the prompt (the regime of the paper's Fig. 4:
a rank-64 7B adapter takes milliseconds to tens of milliseconds over PCIe against 44 ms for a
256-token prefill on an A100); each layer-group copy also pays `--link-latency-us` (PCIe 4.0
x16's, server/config/lora.py). A CPU prefills a 7B layer far more slowly than an A100, so the real
PCIe bandwidth (`--link-gbps 200`) would make every load look free. With `--device cuda` the
loads go over the real link (no throttle) and the result names the GPU.

The device/host split (`--split on`, the default on a CPU: `--device-cores` 0, `--cpu-cores`
1 unless given): every mode's forward pass runs on the device cores, the adapter loader and
(cpu-assisted) the CPU workers on the host cores, so the modes differ only in how the adapter
arrives. `--split off` runs the same shape, protocol and number of CPU workers (one per host
core the split would have had) with nothing pinned: all of them share every core. The result
goes to bench/results/cpu_assisted_split.json or cpu_assisted_nosplit.json (`--out` to change).

`--trace` adds, per mode, the per-layer trace of one cold request (bench/cold_trace.py): when
each layer group's copy ran and became resident, each layer's time in the prefill and its host
LoRA calls, and the totals (copy, host LoRA, forward, their overlap, TTFT). `--rounds 0 --trace`
runs the traces alone.

    GOMP_SPINCOUNT=30000 python -m bench.bench_cpu_assisted --trace
    GOMP_SPINCOUNT=30000 python -m bench.bench_cpu_assisted --trace --split off
    GOMP_SPINCOUNT=30000 python -m bench.bench_cpu_assisted --quick --trace  # checks the driver

`--quick` (2 layers, 6 short requests, one round) writes to /tmp unless `--out` is given.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.cold_trace import trace_cold_request
from bench.common import adapter_bytes, link_gbps_for, prefill_ms, write_random_adapter
from bench.envelope import describe_device, write_result
from toppings.scripts.make_dummy_model import PRESETS, make_dummy_model
from toppings.server.config import PCIE4_X16_LATENCY_US, EngineConfig
from toppings.server.model.loader import load_checkpoint, resolve_model_dir
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.runtime import build_engine
from toppings.server.settings import parse_cores

log = logging.getLogger("bench_cpu_assisted")
TARGETS = ("q_proj", "k_proj", "v_proj")
MODES = ("cached", "on-demand", "cpu-assisted")
QUICK = {"layers": 2, "num_requests": 6, "num_adapters": 6, "prompt_len": 32, "new_tokens": 4,
         "rounds": 1}  # fmt: skip
SPLIT_CORES = ((0,), (1,))  # --split on's device and host cores when neither list is given


def dummy_model(preset: str, layers: int) -> Path:
    """The preset's shapes with `layers` layers, as a weightless checkpoint (made once)."""
    out = Path(f"/tmp/toppings-dummy-{preset}-{layers}l")
    if not (out / "config.json").is_file():
        make_dummy_model(out, {**PRESETS[preset], "num_hidden_layers": layers})
    return out


def make_adapters(root: Path, model_dir: str, count: int, ranks: list[int]) -> dict[str, str]:
    """`count` adapters named a0, a1, ..., adapter i of rank ranks[i % len(ranks)]."""
    paths = {}
    for i in range(count):
        rank = ranks[i % len(ranks)]
        path = root / f"assist-r{rank}-{i}"
        if not (path / "adapter_config.json").is_file():
            write_random_adapter(path, model_dir, rank, TARGETS, seed=100 + i)
        paths[f"a{i}"] = str(path)
    return paths


def poisson_gaps(count: int, interval_s: float, seed: int) -> list[float]:
    """Gaps between `count` arrivals of a Poisson stream of mean gap `interval_s` (the first
    arrives at once)."""
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(1.0 / interval_s) for _ in range(count - 1)]


def run_stream(engine, prompts, names, gaps: list[float], new_tokens: int) -> list:
    """Submit request i after the sum of gaps[:i + 1] (open loop); return their outputs."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start, at = time.perf_counter(), 0.0
    handles = []
    for prompt, name, gap in zip(prompts, names, gaps):
        at += gap
        delay = start + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        handles.append(
            engine.submit(GenerationRequest(prompt, params, engine.resolve_adapter(name)))
        )
    return [h.result(timeout_s=1800) for h in handles]


def warm_up(engine, prompts, names, ranks_of: dict[str, int]) -> float:
    """One burst with a request for an adapter of each rank and one for the base model, prompt
    and decode steps: on a GPU it captures the CUDA graphs of the burst's buckets and sets up
    cuBLAS. The Triton kernels are no longer compiled here: the engine's start-up warm-up
    (--warmup, on with cuda) compiled every variant inside `build_engine`, so that time is in
    `capacity_engine_build_s` (and a kept TRITON_CACHE_DIR loads them). Returns its seconds."""
    first_of_rank = {}
    for name in names:
        first_of_rank.setdefault(ranks_of[name], name)
    burst = [None, *first_of_rank.values()]
    started = time.perf_counter()
    run_stream(engine, prompts[: len(burst)], burst, [0.0] * len(burst), 4)
    return time.perf_counter() - started


def measure_capacity(model_dir: str, config: EngineConfig, adapters: dict, prompts, names,
                     new_tokens: int, ranks_of: dict[str, int],
                     setup: dict[str, float]) -> float:  # fmt: skip
    """Requests per second of a cached engine given every request at once (its best rate),
    after a warm-up burst; `setup` gets the seconds of the engine's build and the warm-up."""
    started = time.perf_counter()
    engine = build_engine(model_dir, config, adapters)
    setup["capacity_engine_build_s"] = time.perf_counter() - started
    try:
        setup["first_burst_warm_up_s"] = warm_up(engine, prompts, names, ranks_of)
        start = time.perf_counter()
        run_stream(engine, prompts, names, [0.0] * len(prompts), new_tokens)
        setup["capacity_burst_s"] = time.perf_counter() - start
        return len(prompts) / setup["capacity_burst_s"]
    finally:
        engine.shutdown()


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "rounds": values}  # fmt: skip


def summarise(outs) -> dict:
    ttft = [o.ttft_s for o in outs]
    tpt = [o.e2e_s / o.output_tokens for o in outs]  # paper: all tokens, prefill included
    return {
        "ttft_mean_ms": 1000 * statistics.mean(ttft),
        "ttft_p50_ms": 1000 * statistics.median(ttft),
        "tpt_mean_ms": 1000 * statistics.mean(tpt),
        "e2e_mean_ms": 1000 * statistics.mean(o.e2e_s for o in outs),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help="a checkpoint directory (default: a dummy model of --preset)")  # fmt: skip
    p.add_argument("--preset", default="llama-2-7b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=4, help="layers of the --preset model")
    p.add_argument("--load-format", default=None, choices=["auto", "dummy"],
                   help="default: dummy for --preset, auto for --model")  # fmt: skip
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--ranks", default="8,16,32,64,128", help="adapter ranks, in turn")
    p.add_argument("--num-adapters", type=int, default=40)
    p.add_argument("--cache-share", type=float, default=0.25,
                   help="device adapter budget (on-demand, cpu-assisted) as a share of all "
                   "adapters' bytes")  # fmt: skip
    p.add_argument("--num-requests", type=int, default=120)
    p.add_argument("--load", type=float, default=0.5,
                   help="offered rate as a fraction of the measured capacity")  # fmt: skip
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--link-gbps", type=float, default=0.0,
                   help="0: set from --load-to-prefill")  # fmt: skip
    p.add_argument("--load-to-prefill", type=float, default=1.0,
                   help="a rank-64 load's time over one prefill's (sets the link)")  # fmt: skip
    p.add_argument("--link-latency-us", type=float, default=PCIE4_X16_LATENCY_US)
    p.add_argument("--split", choices=["on", "off"], default=None,
                   help="the device/host split (default: on for cpu, off for cuda)")  # fmt: skip
    p.add_argument("--device-cores", type=parse_cores, default=(),
                   help="the device side of the split (every mode's forward pass; default "
                   "0)")  # fmt: skip
    p.add_argument("--cpu-cores", type=parse_cores, default=(),
                   help="the host side: loader, cpu-assisted workers (default 1)")  # fmt: skip
    p.add_argument("--cpu-workers", type=int, default=None,
                   help="cpu-assisted's workers (default: one per host core of the split, on "
                   "or off)")  # fmt: skip
    p.add_argument("--cpu-spin-us", type=float, default=0.0, help="see toppings-serve")
    p.add_argument("--rounds", type=int, default=3,
                   help="runs of every mode, order alternating (0: --trace only)")  # fmt: skip
    p.add_argument("--trace", action="store_true",
                   help="add each mode's per-layer trace of one cold request")  # fmt: skip
    p.add_argument("--trace-rank", type=int, default=64,
                   help="the rank of the traced request's adapter (one of --ranks)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--adapter-dir", default=None, help="default: under /tmp, per model")
    p.add_argument("--out", default=None,
                   help="default: bench/results/cpu_assisted_{split,nosplit}.json (--quick: "
                   "/tmp/cpu_assisted_quick_{split,nosplit}.json)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a smoke test of the driver: " +
                   ", ".join(f"{k}={v}" for k, v in QUICK.items()))  # fmt: skip
    args = p.parse_args(argv)
    if args.quick:
        given = set(sys.argv[1:] if argv is None else argv)
        for key, value in QUICK.items():
            if f"--{key.replace('_', '-')}" not in given:
                setattr(args, key, value)
    if args.split is None:
        args.split = "on" if args.device == "cpu" else "off"
    if args.split == "on" and not args.device_cores and not args.cpu_cores:
        args.device_cores, args.cpu_cores = SPLIT_CORES
    elif args.split == "off" and (args.device_cores or args.cpu_cores):
        p.error("--split off pins nothing: drop --device-cores and --cpu-cores")
    if args.cpu_workers is None:
        args.cpu_workers = len(args.cpu_cores or SPLIT_CORES[1])
    if args.rounds < 0 or (args.rounds == 0 and not args.trace):
        p.error("--rounds must be >= 1, or 0 with --trace")
    if args.out is None:
        name = "split" if args.split == "on" else "nosplit"
        where = "/tmp/cpu_assisted_quick" if args.quick else "bench/results/cpu_assisted"
        args.out = f"{where}_{name}.json"
    waits_set = os.environ.get("OMP_WAIT_POLICY") == "PASSIVE" or "GOMP_SPINCOUNT" in os.environ
    if args.cpu_workers and args.device == "cpu" and not waits_set:
        # toppings-serve sets a short spin when it starts workers; it must be set before torch
        # starts OpenMP, whose busy-waiting threads would otherwise starve the workers.
        p.error(
            "with --cpu-workers on a CPU run it as GOMP_SPINCOUNT=N python -m ... (or "
            "OMP_WAIT_POLICY=PASSIVE)"
        )
    return args


def run_rounds(args: argparse.Namespace, model_dir: str, config_for, adapters: dict[str, str],
               prompts: list[list[int]], names: list[str]) -> tuple[dict, dict]:  # fmt: skip
    """The alternating rounds of every mode at `args.load` of the measured capacity: (metrics:
    the headline ratios, per round and per mode; what the run measured for the config)."""
    ranks = [int(r) for r in args.ranks.split(",")]
    ranks_of = {name: ranks[i % len(ranks)] for i, name in enumerate(adapters)}
    setup: dict[str, float] = {}
    capacity = measure_capacity(model_dir, config_for("cached"), adapters, prompts, names,
                                args.new_tokens, ranks_of, setup)  # fmt: skip
    log.info("set-up: %s", {k: round(v, 2) for k, v in setup.items()})
    interval_s = 1.0 / (args.load * capacity)
    log.info("capacity %.3f req/s: a request every %.0f ms on average", capacity,
             1000 * interval_s)  # fmt: skip
    # Modes run one engine at a time; rounds alternate their order (forward, reversed, ...) so
    # that neither the first place nor a slow spell of the machine falls on one mode only.
    outs_by_mode: dict[str, list] = {m: [] for m in MODES}
    per_round: dict[str, list[dict]] = {m: [] for m in MODES}
    counts = {m: {"host_lora_calls": 0, "adapter_loads": 0} for m in MODES}
    for round_idx in range(args.rounds):
        gaps = poisson_gaps(len(prompts), interval_s, seed=args.seed + round_idx)
        for mode in MODES if round_idx % 2 == 0 else MODES[::-1]:
            started = time.perf_counter()
            engine = build_engine(model_dir, config_for(mode), adapters)
            setup["engine_builds_s"] = setup.get("engine_builds_s", 0.0) + (
                time.perf_counter() - started
            )
            try:
                run_stream(engine, prompts[:2], [None, None], [0.0, 0.0], 4)  # warm-up
                outs = run_stream(engine, prompts, names, gaps, args.new_tokens)
                outs_by_mode[mode] += outs
                per_round[mode].append(summarise(outs))
                counts[mode]["host_lora_calls"] += engine.lora.host_stats.calls
                counts[mode]["adapter_loads"] += engine.lora.cache.counters.loads
            finally:
                engine.shutdown()
            log.info("round %d, %s: %s", round_idx, mode, per_round[mode][-1])
    results = {m: {**summarise(outs_by_mode[m]), **counts[m]} for m in MODES}

    def ratios(key: str, mode: str, other: str) -> dict:
        return spread([a[key] / b[key] for a, b in zip(per_round[mode], per_round[other])])

    by_round = {
        "ttft_mean_cpu_assisted_vs_cached": ratios("ttft_mean_ms", "cpu-assisted", "cached"),
        "ttft_p50_cpu_assisted_vs_cached": ratios("ttft_p50_ms", "cpu-assisted", "cached"),
        "ttft_mean_cpu_assisted_vs_on_demand": ratios("ttft_mean_ms", "cpu-assisted", "on-demand"),
        "ttft_p50_cpu_assisted_vs_on_demand": ratios("ttft_p50_ms", "cpu-assisted", "on-demand"),
        "tpt_mean_cpu_assisted_vs_cached": ratios("tpt_mean_ms", "cpu-assisted", "cached"),
    }
    metrics = {  # headline ratios: the median over rounds of each round's ratio of means
        "ttft_ratio_cpu_assisted_vs_cached": by_round["ttft_mean_cpu_assisted_vs_cached"]["median"],
        "ttft_ratio_cpu_assisted_vs_on_demand": by_round["ttft_mean_cpu_assisted_vs_on_demand"][
            "median"
        ],
        "tpt_ratio_cpu_assisted_vs_cached": by_round["tpt_mean_cpu_assisted_vs_cached"]["median"],
        "ratios_by_round": by_round,
        "modes": results,
        "modes_by_round": per_round,
    }
    return metrics, {"capacity_rps": capacity, "interval_ms": 1000 * interval_s,
                     "setup_s": setup}  # fmt: skip


TRACE_TOTALS = ("ttft_ms", "prefill_start_ms", "prefill_ms", "load_ms", "load_resident_ms",
                "host_lora_ms", "host_lora_calls", "forward_less_host_ms",
                "load_prefill_overlap_ms")  # fmt: skip


def run_traces(args: argparse.Namespace, model_dir: str, config_for, adapters: dict[str, str],
               ranks: list[int], prompt: list[int]) -> dict:  # fmt: skip
    """Each mode's trace of one cold request for the first adapter of rank `args.trace_rank`:
    {"trace_summary": mode -> its totals, "trace": mode -> the whole summary, per layer}."""
    rank_of = {name: ranks[i % len(ranks)] for i, name in enumerate(adapters)}
    traced = next((n for n, r in rank_of.items() if r == args.trace_rank), None)
    if traced is None:
        raise SystemExit(f"--trace-rank {args.trace_rank} is not one of --ranks {ranks}")
    traces = {}
    for mode in MODES:
        traces[mode] = {"rank": args.trace_rank, **trace_cold_request(
            model_dir, config_for(mode), adapters, traced, prompt, args.new_tokens
        )}  # fmt: skip
        log.info("trace, %s: %s", mode, {k: traces[mode][k] for k in TRACE_TOTALS})
    summary = {m: {k: t[k] for k in TRACE_TOTALS} for m, t in traces.items()}
    return {"trace_summary": summary, "trace": traces}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.model is None:
        model_dir = str(dummy_model(args.preset, args.layers))
        load_format = args.load_format or "dummy"
    else:
        model_dir = str(resolve_model_dir(args.model))
        load_format = args.load_format or "auto"
    ranks = [int(r) for r in args.ranks.split(",")]
    adapter_dir = Path(args.adapter_dir or f"/tmp/toppings-assist-adapters/{Path(model_dir).name}")
    started = time.perf_counter()
    adapters = make_adapters(adapter_dir, model_dir, args.num_adapters, ranks)
    log.info("adapters ready in %.1f s", time.perf_counter() - started)
    dtype = getattr(torch, args.dtype)
    sizes = {n: adapter_bytes(p, model_dir, dtype) for n, p in adapters.items()}
    vocab = load_checkpoint(model_dir, "dummy").config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(
            min(100, vocab - 1), min(30000, vocab), (args.prompt_len,), generator=gen
        ).tolist()
        for _ in range(args.num_requests)
    ]
    pick = random.Random(args.seed)
    names = [pick.choice(list(adapters)) for _ in prompts]
    split = {"device_cores": args.device_cores, "cpu_cores": args.cpu_cores}
    base_prefill_ms = prefill_ms(model_dir, args.dtype, prompts[0], args.device,
                                 load_format=load_format, **split)  # fmt: skip
    link_gbps = args.link_gbps
    rank64_bytes = adapter_bytes(
        write_random_adapter(adapter_dir / "probe-r64", model_dir, 64, TARGETS, seed=0),
        model_dir, dtype,
    )  # fmt: skip
    if args.device == "cuda":
        link_gbps = 0.0  # the real link
    elif not link_gbps:
        link_gbps = link_gbps_for(rank64_bytes, args.load_to_prefill * base_prefill_ms / 1000)
    # At least room for two of the largest, so that any request can be admitted beside another.
    budget = max(int(args.cache_share * sum(sizes.values())), 2 * max(sizes.values()))

    def config_for(mode: str) -> EngineConfig:
        return EngineConfig(
            device=args.device, dtype=args.dtype, load_format=load_format, lora_mode=mode,
            link_gbps=0.0 if mode == "cached" else link_gbps,
            link_latency_us=args.link_latency_us,
            adapter_cache_bytes=0 if mode == "cached" else budget,
            num_cpu_workers=args.cpu_workers if mode == "cpu-assisted" else 0,
            cpu_spin_us=args.cpu_spin_us,
            max_total_tokens=64 * (args.prompt_len + args.new_tokens), max_batch_size=64,
            **split,
        )  # fmt: skip

    metrics: dict = {}
    measured: dict = {}
    if args.rounds:
        metrics, measured = run_rounds(args, model_dir, config_for, adapters, prompts, names)
    traces = {}
    if args.trace:
        traces = run_traces(args, model_dir, config_for, adapters, ranks, prompts[0])
    split_text = (
        f"device cores {list(args.device_cores)}, host cores {list(args.cpu_cores)}"
        if args.device_cores
        else "no device/host split"
    )
    if args.device == "cuda":
        device = f"{describe_device('cuda')}, real host-to-device link"
        link = "real host-to-device link (not throttled)"
    else:
        device = f"{describe_device()}, emulated link, {split_text}"
        link = (
            f"emulated, {link_gbps:.3f} Gbit/s + {args.link_latency_us:g} us per layer group "
            f"(a rank-64 load = {args.load_to_prefill:g} x one {args.prompt_len}-token prefill)"
        )
    result = write_result(
        args.out,
        "cpu_assisted",
        "bench_cpu_assisted",
        device=device,
        argv=argv,
        config={
            **{k: v for k, v in vars(args).items() if k != "out"},
            "model_dir": model_dir,
            "load_format": load_format,
            "split": split_text,
            "link_gbps_used": link_gbps,
            "rank64_adapter_bytes": rank64_bytes,
            "adapter_cache_bytes": budget,
            **measured,
            "prefill_ms": base_prefill_ms,
            "targets": TARGETS,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT", "default"),
            "load_average_1min_at_end": os.getloadavg()[0],
        },
        metrics={**metrics, "link": link, **traces},
    )
    print(json.dumps(result["metrics"], indent=2))


if __name__ == "__main__":
    main()
