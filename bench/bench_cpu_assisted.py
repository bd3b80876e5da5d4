"""TTFT and time per token of cached / on-demand / cpu-assisted when every request needs a load.

A stream of requests arrives at a fixed interval, each for a rank-64 adapter that is not yet on
the device (except in `cached`, where every adapter is preloaded: the ideal upper bound). The
interval is set from this machine's capacity, measured first (`cached`, every request submitted
at once: requests per second): `--load 0.5` offers half of it. Every mode runs `--rounds` times,
in alternating order; the ratios are taken per round and reported as the median with the
spread across rounds. On a
CPU the "device" load is a real copy throttled by `--link-gbps`; by default the link speed is
set so that loading one adapter takes as long as prefilling one prompt (the regime of the
Toppings paper's Fig. 4) and the result is labelled "emulated link". With `--device cuda` the
loads go over the real host-to-device link (no throttle) and the result names the GPU. For the
paper's shapes, make a random model with Llama-7B layers first (fewer layers keep it quick):

    python -m bench.bench_cpu_assisted --out bench/results/cpu_assisted.json
    python -m toppings.scripts.make_tiny_llama /tmp/llama7b-8l --layers 8 --hidden 4096 \
        --intermediate 11008 --heads 32 --kv-heads 32 --vocab 32000 --max-positions 4096
    python -m bench.bench_cpu_assisted --device cuda --model /tmp/llama7b-8l --cpu-workers 8 \
        --out bench/results/cpu_assisted_cuda.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

from bench.common import adapter_bytes, link_gbps_for, prefill_ms
from bench.envelope import describe_device, write_result
from toppings.scripts.make_adapters import make_random_adapter
from toppings.server.config import EngineConfig
from toppings.server.model.loader import resolve_model_dir
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.runtime import build_engine

log = logging.getLogger("bench_cpu_assisted")
TARGETS = ("q_proj", "k_proj", "v_proj")
MODES = ("cached", "on-demand", "cpu-assisted")


def make_adapters(root: Path, model_dir: Path, count: int, rank: int) -> dict[str, str]:
    paths = {}
    for i in range(count):
        path = root / f"assist-r{rank}-{i}"
        if not (path / "adapter_config.json").is_file():
            make_random_adapter(path, model_dir, rank=rank, target_modules=TARGETS, seed=100 + i)
        paths[f"a{i}"] = str(path)
    return paths


def run_stream(engine, prompts, names, interval_s: float, new_tokens: int) -> list:
    """Submit one request per interval (open loop); return their final outputs."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    handles = []
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        delay = start + i * interval_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        handles.append(engine.submit(GenerationRequest(prompt, params, name)))
    return [h.result(timeout_s=600) for h in handles]


def measure_capacity(model_dir: str, config: EngineConfig, adapters: dict, prompts, names,
                     new_tokens: int) -> float:  # fmt: skip
    """Requests per second of a cached engine given every request at once (its best rate)."""
    engine = build_engine(model_dir, config, adapters)
    try:
        run_stream(engine, prompts[:2], [None, None], 0.0, 4)  # warm-up
        start = time.perf_counter()
        run_stream(engine, prompts, names, 0.0, new_tokens)
        return len(prompts) / (time.perf_counter() - start)
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=120)
    p.add_argument("--load", type=float, default=0.5,
                   help="offered rate as a fraction of the measured capacity")  # fmt: skip
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--link-gbps", type=float, default=0.0,
                   help="0: set so one adapter load takes one prefill's time")  # fmt: skip
    p.add_argument("--cpu-workers", type=int, default=0)
    p.add_argument("--cpu-spin-us", type=float, default=0.0, help="see toppings-serve")
    p.add_argument("--rounds", type=int, default=3, help="runs of every mode, order alternating")
    p.add_argument("--adapter-dir", default="/tmp/toppings-assist-adapters")
    p.add_argument("--out", default="bench/results/cpu_assisted.json")
    args = p.parse_args(argv)
    if args.cpu_workers and args.device == "cpu" and os.environ.get("OMP_WAIT_POLICY") != "PASSIVE":
        # toppings-serve sets it when it starts workers; it must be set before torch starts
        # OpenMP, whose busy-waiting threads would otherwise starve the workers.
        p.error("with --cpu-workers on a CPU run it as OMP_WAIT_POLICY=PASSIVE python -m ...")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model_dir = str(resolve_model_dir(args.model))
    adapters = make_adapters(Path(args.adapter_dir), Path(model_dir), args.num_requests, args.rank)
    from toppings.server.model.loader import load_checkpoint

    vocab = load_checkpoint(model_dir).config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(
            min(100, vocab - 1), min(40000, vocab), (args.prompt_len,), generator=gen
        ).tolist()
        for _ in range(args.num_requests)
    ]
    names = list(adapters)  # each request its own adapter: every one needs a load
    base_prefill_ms = prefill_ms(model_dir, args.dtype, prompts[0], args.device)
    link_gbps = args.link_gbps
    if args.device == "cuda":
        link_gbps = 0.0  # the real link
    elif not link_gbps:
        nbytes = adapter_bytes(adapters["a0"], model_dir, getattr(torch, args.dtype))
        link_gbps = link_gbps_for(nbytes, base_prefill_ms / 1000)

    def config_for(mode: str) -> EngineConfig:
        return EngineConfig(
            device=args.device, dtype=args.dtype, lora_mode=mode,
            link_gbps=0.0 if mode == "cached" else link_gbps,
            num_cpu_workers=args.cpu_workers if mode == "cpu-assisted" else 0,
            cpu_spin_us=args.cpu_spin_us,
            max_total_tokens=64 * (args.prompt_len + args.new_tokens), max_batch_size=64,
        )  # fmt: skip

    capacity = measure_capacity(model_dir, config_for("cached"), adapters, prompts, names,
                                args.new_tokens)  # fmt: skip
    interval_s = 1.0 / (args.load * capacity)
    log.info("capacity %.2f req/s: one request every %.0f ms", capacity, 1000 * interval_s)
    # Modes run one engine at a time; rounds alternate their order (forward, reversed, ...) so
    # that neither the first place nor a slow spell of the machine falls on one mode only.
    outs_by_mode: dict[str, list] = {m: [] for m in MODES}
    per_round: dict[str, list[dict]] = {m: [] for m in MODES}
    counts = {m: {"host_lora_calls": 0, "adapter_loads": 0} for m in MODES}
    for round_idx in range(args.rounds):
        for mode in MODES if round_idx % 2 == 0 else MODES[::-1]:
            engine = build_engine(model_dir, config_for(mode), adapters)
            try:
                run_stream(engine, prompts[:2], [None, None], 0.0, 4)  # warm-up, no adapter
                outs = run_stream(engine, prompts, names, interval_s, args.new_tokens)
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
    if args.device == "cuda":
        device = f"{describe_device('cuda')}, real host-to-device link"
        link = "real host-to-device link (not throttled)"
    else:
        device = f"{describe_device()}, emulated link"
        link = f"emulated, {link_gbps:.3f} Gbit/s (one adapter load = one 128-token prefill)"
    result = write_result(
        args.out,
        "cpu_assisted",
        "bench_cpu_assisted",
        device=device,
        argv=argv,
        config={
            **{k: v for k, v in vars(args).items() if k != "out"},
            "link_gbps_used": link_gbps,
            "capacity_rps": capacity,
            "interval_ms": 1000 * interval_s,
            "prefill_128_ms": base_prefill_ms,
            "targets": TARGETS,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
            "load_average_1min_at_end": os.getloadavg()[0],
        },
        metrics={  # headline ratios: the median over rounds of each round's ratio of means
            "ttft_ratio_cpu_assisted_vs_cached": by_round["ttft_mean_cpu_assisted_vs_cached"][
                "median"
            ],
            "ttft_ratio_cpu_assisted_vs_on_demand": by_round["ttft_mean_cpu_assisted_vs_on_demand"][
                "median"
            ],
            "tpt_ratio_cpu_assisted_vs_cached": by_round["tpt_mean_cpu_assisted_vs_cached"][
                "median"
            ],
            "link": link,
            "ratios_by_round": by_round,
            "modes": results,
            "modes_by_round": per_round,
        },
    )
    print(json.dumps(result["metrics"], indent=2))


if __name__ == "__main__":
    main()
