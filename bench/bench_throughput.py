"""Output tokens/s of our engine against transformers + PEFT on the same mixed-adapter requests.

Both sides run in this process, one after the other, on the same prompts, adapters, weights and
dtype. transformers + PEFT uses batched `generate(adapter_names=...)`; it is timed at several
batch sizes and its fastest is the baseline. Ours runs `--rounds` times with the adapters and
without, in alternating order on fresh prompts: tokens/s is the median round's, the decode step
ratio with / without LoRA the median of the rounds' ratios. Each round also runs the adapters on
a second engine with 1 thread (threads_speedup = the median of the rounds' all cores / 1 thread
ratios: this VM's speed drifts over seconds, so only runs side by side compare). One request
alone (TTFT and time per output token, ours and transformers', base and one adapter), and the
greedy tokens of both on a short prompt (`agreement`: the fraction of our tokens transformers
also picks when fed ours so far).

`roofline_fraction` (bench/roofline.py): a decode step's least time on this machine, the larger
of its linear FLOPs / the peak GEMM rate of the model's own projections (at 16 prompts' rows) and
the bytes it must read (weights + KV + the adapters) / the measured read bandwidth, over the median
LoRA round's decode step. `roofline_fraction_gemm`: the time the whole run's linear FLOPs take
at those GEMM rates (prefill at 16 prompts' rows) over the run's time.

A real-size model without its weights: `--model-preset llama-3.2-1b|qwen2.5-1.5b` (or `--dummy
CONFIG.json`) writes the config and a tokenizer once under the toppings cache and serves it
with `load_format=dummy`; transformers gets the same drawn tensors (bench.hf_peft_peer), and
the adapters are made on that model. `--quick` is a few-minute smoke run of the same path.

    python -m bench.bench_throughput --threads 0 --out bench/results/engine_throughput.json
    python -m bench.bench_throughput --model-preset llama-3.2-1b --dtype bfloat16 \
        --out bench/results/engine_throughput_1b.json
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import logging
import os
import resource
import statistics
import time

import torch

from bench.envelope import describe_device, write_result
from bench.hf_peft_peer import attach_adapters, load_base
from bench.roofline import decode_step_bytes, gemm_gflops, linear_flops, memory_bandwidth_gbs
from bench.throughput_peer import (
    agreement,
    generate,
    run_hf_peft,
    run_hf_single,
    teacher_forced,
)
from bench.throughput_workload import (
    DUMMY_TARGETS,
    RANKS,
    TARGETS,
    Model,
    make_workload,
    pick_model,
    random_prompts,
)
from toppings.scripts.make_dummy_model import PRESETS
from toppings.server.config import EngineConfig, LoadFormat
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.runtime import build_engine

log = logging.getLogger("bench_throughput")
WARM_UP_SEED = 1_000_000  # rounds use seeds 0, 1, ...: the warm-up leaves them no cached prefix
CHECK_PROMPT_LEN = 16  # the agreement check's prompt: the first tokens of the first prompt
# --quick: the whole path (both sides, every metric) on a small workload, in a few minutes.
QUICK = {
    "num_requests": 8,
    "prompt_len": 32,
    "new_tokens": 16,
    "rounds": 1,
    "single_rounds": 1,
    "hf_batch_sizes": "8",
    "one_thread_engine": False,
}


def median_run(runs: list[dict]) -> dict:
    """The run of median tokens/s (its own decode step time with it)."""
    return sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]


def run_ours(engine, prompts, names, new_tokens: int) -> dict:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.step_stats.reset()
    start = time.perf_counter()
    handles = [
        engine.submit(GenerationRequest(p, params, engine.resolve_adapter(n)))
        for p, n in zip(prompts, names)
    ]
    outs = [h.result() for h in handles]
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.new_token_ids) for o in outs)
    st = engine.step_stats
    return {
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "decode_step_ms": 1000 * st.decode_s / max(st.decode_steps, 1),
        "decode_steps": st.decode_steps,
    }


def greedy_ours(engine, prompt: list[int], adapter: str | None, new_tokens: int) -> list[int]:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return list(
        engine.submit(GenerationRequest(prompt, params, engine.resolve_adapter(adapter)))
        .result()
        .new_token_ids
    )


def run_single(engine, prompt, adapter: str | None, new_tokens: int, rounds: int) -> dict:
    """One request alone: median TTFT and time per output token over `rounds` runs (ms)."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ttft, tpot = [], []
    for _ in range(rounds):
        out = engine.submit(
            GenerationRequest(prompt, params, engine.resolve_adapter(adapter))
        ).result()
        ttft.append(out.ttft_s * 1e3)
        tpot.append((out.e2e_s - out.ttft_s) * 1e3 / (new_tokens - 1))
    return {"ttft_ms": statistics.median(ttft), "tpot_ms": statistics.median(tpot)}


def run_engine_side(args, model: Model, adapters, prompts, names, vocab: int, threads: int):
    """Every measurement of ours (see the module doc); the engines are shut down on return."""
    config = EngineConfig(
        dtype=args.dtype,
        kernel=args.kernel,
        max_batch_size=args.num_requests,
        max_total_tokens=args.num_requests * (args.prompt_len + args.new_tokens),
        num_threads=threads,
        load_format=model.load_format.value,
    )
    started = time.perf_counter()
    engine = build_engine(str(model.path), config, adapters)
    startup_s = time.perf_counter() - started
    # The engine thread sets its own OpenMP team size: a second engine for the 1-thread runs,
    # which take their turn in every round (threads_speedup: the median of the rounds' ratios).
    engine_1 = None
    if args.one_thread_engine:
        engine_1 = build_engine(
            str(model.path), dataclasses.replace(config, num_threads=1), adapters
        )
    engines = {"lora": engine, "base": engine, "lora_1_thread": engine_1}
    kinds = ("lora", "base", "lora_1_thread") if engine_1 else ("lora", "base")
    out: dict = {"startup_s": startup_s, "runs": {k: [] for k in kinds}}
    try:
        warm_up = random_prompts(args, vocab, seed=WARM_UP_SEED)[:8]  # none the rounds send
        for eng in {engines[k] for k in kinds}:
            run_ours(eng, warm_up, names[:8], 8)
        # Rounds alternate which goes first; each round has fresh prompts (no prefix-cache hits).
        for round_idx in range(args.rounds):
            batch = prompts if round_idx == 0 else random_prompts(args, vocab, seed=round_idx)
            for kind in kinds if round_idx % 2 == 0 else kinds[::-1]:
                adapter_names = [None] * len(batch) if kind == "base" else names
                out["runs"][kind].append(
                    run_ours(engines[kind], batch, adapter_names, args.new_tokens)
                )
        # Anything else alive in the process slows one request alone (an idle engine with
        # adapters took transformers' time per token from 36 to 48 ms): only this engine stays.
        if engine_1:
            engine_1.shutdown()
        out["single"] = {
            label: run_single(engine, prompts[0], adapter, args.new_tokens, args.single_rounds)
            for label, adapter in (("base", None), ("adapter", names[0]))
        }
        check = prompts[0][:CHECK_PROMPT_LEN]
        out["greedy"] = {
            label: greedy_ours(engine, check, adapter, args.check_tokens)
            for label, adapter in (("base", None), ("adapter", names[0]))
        }
        out["model_config"] = engine.model_config
        rows = (args.num_requests, args.prompt_len * 16)
        out["gemm"] = {n: gemm_gflops(engine.model, n) for n in rows}
        out["bandwidth_gbs"] = memory_bandwidth_gbs()
        out["itemsize"] = engine.model.dtype.itemsize
    finally:
        engine.shutdown()
        if engine_1:
            engine_1.shutdown()
    return out


def run_peer_side(args, model: Model, adapters, prompts, names, ours_greedy: dict) -> dict:
    """transformers alone (one request, agreement with `ours_greedy`), + PEFT with one adapter
    (the same), then + PEFT with every adapter at each batch size; one model, built once."""
    dtype = getattr(torch, args.dtype)
    check = prompts[0][:CHECK_PROMPT_LEN]
    single, agree = {}, {}
    hf = load_base(model.path, dtype, model.load_format)
    for label, adapter in (("base", None), ("adapter", names[0])):
        if adapter:
            hf = attach_adapters(hf, {adapter: adapters[adapter]})
        single[label] = run_hf_single(hf, prompts[0], adapter, args.new_tokens, args.single_rounds)
        adapter_names = [adapter] if adapter else None
        theirs = generate(hf, [check], adapter_names, args.check_tokens)[0].tolist()
        forced = teacher_forced(hf, check, ours_greedy[label], adapter)
        agree[label] = agreement(ours_greedy[label], theirs, forced)
    for name in sorted(set(names) - {names[0]}):
        hf.load_adapter(adapters[name], adapter_name=name)
    hf.eval()
    runs = []
    for bs in (int(b) for b in args.hf_batch_sizes.split(",")):
        limit = args.hf_bs1_requests if bs == 1 else args.num_requests
        runs.append(run_hf_peft(hf, prompts[:limit], names[:limit], args.new_tokens, bs))
        log.info("transformers+peft: %s", runs[-1])
    return {"single": single, "agreement": agree, "runs": runs}


def summarize(args, ours: dict, peer: dict, targets: tuple[str, ...]) -> dict:
    """The result's metrics from both sides' measurements (headlines first)."""
    runs = ours["runs"]
    lora, base = median_run(runs["lora"]), median_run(runs["base"])
    best = max(peer["runs"], key=lambda r: r["tokens_per_s"])

    mc, gemm = ours["model_config"], ours["gemm"]
    step_ratios = [
        a["decode_step_ms"] / b["decode_step_ms"] for a, b in zip(runs["lora"], runs["base"])
    ]
    # Roofline of the whole run at the GEMM rates (prefill at 16 prompts' rows).
    prefill_flops, decode_flops = linear_flops(
        mc, args.prompt_len, args.new_tokens, args.num_requests
    )
    gemm_run_s = (
        prefill_flops / gemm[args.prompt_len * 16] + decode_flops / gemm[args.num_requests]
    ) / 1e9
    # Roofline of one decode step: FLOPs at the GEMM rate or bytes at the bandwidth, the larger.
    ranks = [RANKS[i % len(RANKS)] for i in range(min(args.num_adapters, args.num_requests))]
    context = args.prompt_len + args.new_tokens / 2  # the mean over the decode steps
    step_bytes = decode_step_bytes(mc, ours["itemsize"], args.num_requests, context, ranks, targets)
    step_flops = decode_flops / (args.new_tokens - 1)
    # The peak rate: at the decode batch a GEMM is itself bound by reading its weights, which
    # the bytes term already counts.
    step_compute_s = step_flops / max(gemm.values()) / 1e9
    step_memory_s = sum(step_bytes.values()) / ours["bandwidth_gbs"] / 1e9
    step_s = lora["decode_step_ms"] / 1e3
    single, single_hf = ours["single"], peer["single"]
    single_ratios = {
        f"{kind}_ratio_vs_hf_{label}": single[label][f"{kind}_ms"] / single_hf[label][f"{kind}_ms"]
        for label in single
        for kind in ("ttft", "tpot")
    }
    metrics = {
        "tokens_per_s": lora["tokens_per_s"],
        "tokens_per_s_hf_peft": best["tokens_per_s"],
        "hf_peft_best_batch_size": best["batch_size"],
        "ratio_vs_hf_peft": lora["tokens_per_s"] / best["tokens_per_s"],
        "decode_step_ms_lora": lora["decode_step_ms"],
        "decode_step_ms_base": base["decode_step_ms"],
        "decode_step_ratio_lora_vs_base": statistics.median(step_ratios),
        "rounds": {
            "tokens_per_s_lora": [r["tokens_per_s"] for r in runs["lora"]],
            "tokens_per_s_base": [r["tokens_per_s"] for r in runs["base"]],
            "decode_step_ratio_lora_vs_base": step_ratios,
        },
        "tokens_per_s_base_only": base["tokens_per_s"],
        "roofline_fraction": max(step_compute_s, step_memory_s) / step_s,
        "roofline": {
            "bound": "compute" if step_compute_s >= step_memory_s else "memory",
            "decode_step_ms_compute": step_compute_s * 1e3,
            "decode_step_ms_memory": step_memory_s * 1e3,
            "decode_step_bytes": step_bytes,
            "decode_step_gflop": step_flops / 1e9,
            "memory_bandwidth_gbs": ours["bandwidth_gbs"],
            "mean_context": context,
        },
        "roofline_fraction_gemm": gemm_run_s / lora["seconds"],
        "gemm_gflops": (prefill_flops + decode_flops) / gemm_run_s / 1e9,
        "gemm_gflops_decode_batch": gemm[args.num_requests],
        "gemm_gflops_prefill": gemm[args.prompt_len * 16],
        "ttft_ms_single": single["base"]["ttft_ms"],
        "tpot_ms_single": single["base"]["tpot_ms"],
        "single": {"ours": single, "transformers": single_hf, **single_ratios},
        "agreement": peer["agreement"],
        "startup_s": ours["startup_s"],
        "hf_peft_runs": peer["runs"],
    }
    if "lora_1_thread" in runs:
        speedups = [
            a["tokens_per_s"] / b["tokens_per_s"]
            for a, b in zip(runs["lora"], runs["lora_1_thread"])
        ]
        metrics["rounds"]["tokens_per_s_1_thread"] = [
            r["tokens_per_s"] for r in runs["lora_1_thread"]
        ]
        metrics["rounds"]["threads_speedup"] = speedups
        metrics["tokens_per_s_1_thread"] = median_run(runs["lora_1_thread"])["tokens_per_s"]
        metrics["threads_speedup"] = statistics.median(speedups)
    return metrics


def release_freed_memory() -> None:
    """Hand memory freed by dropped models back to the OS. glibc keeps freed heap pages (in the
    arena of the thread that allocated them: the engine thread's are never reused by this one),
    so without this the next side of a real-size run would sit beside a dead model's pages."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing held back to release
        pass


def peak_rss_gib() -> float:
    """The peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", default="smollm2", help="what toppings-serve --model takes")
    model.add_argument(
        "--model-preset",
        choices=sorted(PRESETS),
        help="a published model's shapes with dummy weights",
    )
    model.add_argument(
        "--dummy",
        metavar="CONFIG",
        help="a config.json, or a directory with config.json and a tokenizer: dummy weights",
    )
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--num-adapters", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--targets",
        help="adapter projections, comma-separated (default: q,k,v; "
        "q,k,v,o for --model-preset and --dummy)",
    )
    p.add_argument("--kernel", default="mbgmv", choices=["bgmv", "mbgmv"])
    p.add_argument("--hf-batch-sizes", default="1,8,64")
    p.add_argument(
        "--hf-bs1-requests",
        type=int,
        default=8,
        help="requests timed at batch size 1 (tokens/s over them; all 64 take minutes)",
    )
    p.add_argument("--single-rounds", type=int, default=5, help="runs of the one-request test")
    p.add_argument("--check-tokens", type=int, default=8, help="greedy tokens compared")
    p.add_argument("--rounds", type=int, default=3, help="alternating runs, with/without LoRA")
    p.add_argument(
        "--one-thread-engine",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time a second, 1-thread engine each round (a second copy in memory)",
    )
    p.add_argument(
        "--quick", action="store_true", help=f"smoke run, overriding the workload: {QUICK}"
    )
    p.add_argument("--adapter-dir", default="/tmp/toppings-bench-adapters")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0: every core")
    p.add_argument("--out", default="bench/results/engine_throughput.json")
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model = pick_model(args)
    dummy = model.load_format is LoadFormat.DUMMY
    default_targets = DUMMY_TARGETS if dummy else TARGETS
    targets = tuple(args.targets.split(",")) if args.targets else default_targets
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model.path).vocab_size
    adapters, prompts, names = make_workload(args, model, vocab, targets)
    release_freed_memory()  # the model the adapters were made on (when made in this run)
    ours = run_engine_side(args, model, adapters, prompts, names, vocab, threads)
    release_freed_memory()
    rss_engine_gib = peak_rss_gib()
    lora, base = median_run(ours["runs"]["lora"]), median_run(ours["runs"]["base"])
    log.info("ours: %s; base model only: %s", lora, base)
    peer = run_peer_side(args, model, adapters, prompts, names, ours["greedy"])
    metrics = summarize(args, ours, peer, targets)
    metrics["peak_rss_gib"] = {"through_ours": rss_engine_gib, "overall": peak_rss_gib()}
    result = write_result(
        args.out,
        "engine_throughput",
        "bench_throughput",
        device=describe_device(),
        argv=argv,
        config={
            **{k: v for k, v in vars(args).items() if k != "out"},
            "model_dir": str(model.path),
            "load_format": model.load_format.value,
            "threads": threads,
            "targets": targets,
            "ranks": RANKS,
            "ours": "in-process engine, all requests submitted at once",
            "gemm": "model's own packed projections (layer 0 + lm_head), best of 5, at the decode"
            " batch and at 16 prompts' tokens",
            "bandwidth": "best of 5 sums of a 512 MiB float32 buffer, all threads",
            "load_average_1min_before_after": [load_before[0], os.getloadavg()[0]],
            "peak_rss_gib": "the process's peak resident memory by the end of ours, and overall",
        },
        metrics=metrics,
    )
    print(json.dumps(result["metrics"], indent=2))


if __name__ == "__main__":
    main()
