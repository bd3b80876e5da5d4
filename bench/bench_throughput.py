"""Output tokens/s of our engine against transformers + PEFT on the same mixed-adapter requests.

Both sides run in this process, one after the other, on the same prompts, adapters and dtype.
transformers + PEFT uses batched `generate(adapter_names=...)`; it is timed at several batch
sizes and its fastest is the baseline. Ours runs `--rounds` times with the adapters and without,
in alternating order on fresh prompts: tokens/s is the median round's, the decode step ratio
with / without LoRA the median of the rounds' ratios. Each round also runs the adapters on a
second engine with 1 thread (threads_speedup = the median of the rounds' all cores / 1 thread
ratios: this VM's speed drifts over seconds, so only runs side by side compare). One request
alone (128-token prompt: TTFT and time per output token, ours and transformers', base and one
adapter); and the GEMM rate of the model's own projections at the decode batch and at the
prefill size (`gemm_gflops`), from which `roofline_fraction` = the time those GEMMs would take
for the run's linear-layer FLOPs / the run's time.

    python -m bench.bench_throughput --threads 0 --out bench/results/engine_throughput.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

from bench.envelope import describe_device, write_result
from toppings.scripts.make_adapters import make_random_adapter
from toppings.server.config import EngineConfig
from toppings.server.model.loader import resolve_model_dir
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.runtime import build_engine

log = logging.getLogger("bench_throughput")
RANKS = (8, 16, 32, 64)
TARGETS = ("q_proj", "k_proj", "v_proj")


def make_workload(args, model_dir: Path, vocab: int):
    root = Path(args.adapter_dir)
    adapters = {}
    for i in range(args.num_adapters):
        rank = RANKS[i % len(RANKS)]
        path = root / f"bench-r{rank}-{i}"
        if not (path / "adapter_config.json").is_file():
            make_random_adapter(path, model_dir, rank=rank, target_modules=TARGETS, seed=i)
        adapters[f"a{i}"] = str(path)
    prompts = random_prompts(args, vocab, seed=0)
    names = [f"a{i % args.num_adapters}" for i in range(args.num_requests)]
    return adapters, prompts, names


def random_prompts(args, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(100, vocab, (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.num_requests)
    ]


def median_run(runs: list[dict]) -> dict:
    """The run of median tokens/s (its own decode step time with it)."""
    return sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]


def run_ours(engine, prompts, names, new_tokens: int) -> dict:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.step_stats.reset()
    start = time.perf_counter()
    handles = [engine.submit(GenerationRequest(p, params, n)) for p, n in zip(prompts, names)]
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


def linear_flops(cfg, prompt_len: int, new_tokens: int, num_requests: int) -> tuple[int, int]:
    """(prefill, decode) FLOPs of the workload's linear layers (attention scores not counted).

    Prefill runs the layers over every prompt token and lm_head over the last one; each later
    token runs both once (the last sampled token is never fed back).
    """
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    per_layer = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h + 3 * h * i
    layers = 2 * per_layer * cfg.num_layers
    head = 2 * h * cfg.vocab_size
    prefill = num_requests * (prompt_len * layers + head)
    decode = num_requests * (new_tokens - 1) * (layers + head)
    return prefill, decode


def gemm_gflops(model, num_tokens: int, rounds: int = 5) -> float:
    """GFLOP/s of the model's own projections (layer 0 and lm_head) at num_tokens rows."""
    layer = model.layers[0]
    linears = [layer.qkv, layer.o, layer.gate_up, layer.down, model.lm_head]
    xs = [torch.randn(num_tokens, lin.in_features, dtype=model.dtype) for lin in linears]
    flops = sum(2 * num_tokens * lin.in_features * lin.out_features for lin in linears)
    for lin, x in zip(linears, xs):
        lin(x)  # warm-up
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for lin, x in zip(linears, xs):
            lin(x)
        best = min(best, time.perf_counter() - start)
    return flops / best / 1e9


def run_single(engine, prompt, adapter: str | None, new_tokens: int, rounds: int) -> dict:
    """One request alone: median TTFT and time per output token over `rounds` runs (ms)."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ttft, tpot = [], []
    for _ in range(rounds):
        out = engine.submit(GenerationRequest(prompt, params, adapter)).result()
        ttft.append(out.ttft_s * 1e3)
        tpot.append((out.e2e_s - out.ttft_s) * 1e3 / (new_tokens - 1))
    return {"ttft_ms": statistics.median(ttft), "tpot_ms": statistics.median(tpot)}


def run_hf_single(model, prompt, adapter: str | None, new_tokens: int, rounds: int) -> dict:
    """transformers (+ PEFT for an adapter) on one request: TTFT = a 1-token generate, TPOT
    from the rest."""
    ids = torch.tensor([prompt])
    kwargs = {"adapter_names": [adapter]} if adapter else {}

    def generate(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0, **kwargs)  # fmt: skip
        return (time.perf_counter() - start) * 1e3

    generate(2)  # warm-up
    ttft = statistics.median(generate(1) for _ in range(rounds))
    total = statistics.median(generate(new_tokens) for _ in range(rounds))
    return {"ttft_ms": ttft, "tpot_ms": (total - ttft) / (new_tokens - 1)}


def load_hf_peft(model_dir, adapters: dict[str, str], dtype):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    items = list(adapters.items())
    model = PeftModel.from_pretrained(base, items[0][1], adapter_name=items[0][0])
    for name, path in items[1:]:
        model.load_adapter(path, adapter_name=name)
    return model.eval()


def run_hf_peft(model_dir, adapters, prompts, names, new_tokens, batch_size, dtype, limit):
    model = load_hf_peft(model_dir, adapters, dtype)
    prompts, names = prompts[:limit], names[:limit]
    tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            ids = torch.tensor(prompts[i : i + batch_size])
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                adapter_names=names[i : i + batch_size],
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    elapsed = time.perf_counter() - start
    return {
        "batch_size": batch_size,
        "requests": len(prompts),
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--num-adapters", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--kernel", default="mbgmv", choices=["bgmv", "mbgmv"])
    p.add_argument("--hf-batch-sizes", default="1,8,64")
    p.add_argument(
        "--hf-bs1-requests",
        type=int,
        default=8,
        help="requests timed at batch size 1 (tokens/s over them; all 64 take minutes)",
    )
    p.add_argument("--single-rounds", type=int, default=5, help="runs of the one-request test")
    p.add_argument("--rounds", type=int, default=3, help="alternating runs, with/without LoRA")
    p.add_argument("--adapter-dir", default="/tmp/toppings-bench-adapters")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0: every core")
    p.add_argument("--out", default="bench/results/engine_throughput.json")
    args = p.parse_args(argv)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model_dir = resolve_model_dir(args.model)
    dtype = getattr(torch, args.dtype)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    adapters, prompts, names = make_workload(args, model_dir, vocab)
    config = EngineConfig(
        dtype=args.dtype,
        kernel=args.kernel,
        max_batch_size=args.num_requests,
        max_total_tokens=args.num_requests * (args.prompt_len + args.new_tokens),
        num_threads=threads,
    )
    started = time.perf_counter()
    engine = build_engine(str(model_dir), config, adapters)
    startup_s = time.perf_counter() - started
    # The engine thread sets its own OpenMP team size: a second engine for the 1-thread runs,
    # which take their turn in every round (threads_speedup: the median of the rounds' ratios).
    engine_1 = build_engine(str(model_dir), dataclasses.replace(config, num_threads=1), adapters)
    single, single_hf = {}, {}
    try:
        for eng in (engine, engine_1):
            run_ours(eng, prompts[:8], names[:8], 8)  # warm-up
        # Rounds alternate which goes first; each round has fresh prompts (no prefix-cache hits).
        runs: dict[str, list[dict]] = {"lora": [], "base": [], "lora_1_thread": []}
        for round_idx in range(args.rounds):
            batch = prompts if round_idx == 0 else random_prompts(args, vocab, seed=round_idx)
            order = ("lora", "base", "lora_1_thread")
            for kind in order if round_idx % 2 == 0 else order[::-1]:
                eng = engine_1 if kind == "lora_1_thread" else engine
                adapter_names = [None] * len(batch) if kind == "base" else names
                runs[kind].append(run_ours(eng, batch, adapter_names, args.new_tokens))
        # Anything else alive in the process slows one request alone (an idle engine with
        # adapters took transformers' time per token from 36 to 48 ms): only this engine stays.
        engine_1.shutdown()
        ours, base = median_run(runs["lora"]), median_run(runs["base"])
        ours_1 = median_run(runs["lora_1_thread"])
        step_ratios = [a["decode_step_ms"] / b["decode_step_ms"]
                       for a, b in zip(runs["lora"], runs["base"])]  # fmt: skip
        speedups = [a["tokens_per_s"] / b["tokens_per_s"]
                    for a, b in zip(runs["lora"], runs["lora_1_thread"])]  # fmt: skip
        for label, adapter in (("base", None), ("adapter", names[0])):
            single[label] = run_single(engine, prompts[0], adapter, args.new_tokens,
                                       args.single_rounds)  # fmt: skip
        mc = engine.model_config
        gemm = {n: gemm_gflops(engine.model, n) for n in (args.num_requests, args.prompt_len * 16)}
    finally:
        engine.shutdown()
        engine_1.shutdown()
    log.info("ours: %s; base model only: %s; 1 thread: %s", ours, base, ours_1)
    from transformers import AutoModelForCausalLM

    # The base model alone is plain transformers; the adapter goes through PEFT.
    hf_base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    single_hf["base"] = run_hf_single(hf_base, prompts[0], None, args.new_tokens,
                                      args.single_rounds)  # fmt: skip
    del hf_base
    hf_model = load_hf_peft(model_dir, {names[0]: adapters[names[0]]}, dtype)
    single_hf["adapter"] = run_hf_single(hf_model, prompts[0], names[0], args.new_tokens,
                                         args.single_rounds)  # fmt: skip
    del hf_model
    hf_runs = []
    for bs in (int(b) for b in args.hf_batch_sizes.split(",")):
        limit = args.hf_bs1_requests if bs == 1 else args.num_requests
        hf_runs.append(
            run_hf_peft(model_dir, adapters, prompts, names, args.new_tokens, bs, dtype, limit)
        )
        log.info("transformers+peft: %s", hf_runs[-1])
    best = max(hf_runs, key=lambda r: r["tokens_per_s"])
    prefill_flops, decode_flops = linear_flops(mc, args.prompt_len, args.new_tokens,
                                               args.num_requests)  # fmt: skip
    roofline_s = (
        prefill_flops / gemm[args.prompt_len * 16] + decode_flops / gemm[args.num_requests]
    ) / 1e9
    single_ratios = {
        f"{kind}_ratio_vs_hf_{label}": single[label][f"{kind}_ms"] / single_hf[label][f"{kind}_ms"]
        for label in single for kind in ("ttft", "tpot")
    }  # fmt: skip
    result = write_result(
        args.out,
        "engine_throughput",
        "bench_throughput",
        device=describe_device(),
        argv=argv,
        config={
            **{k: v for k, v in vars(args).items() if k != "out"},
            "threads": threads,
            "targets": TARGETS,
            "ranks": RANKS,
            "ours": "in-process engine, all requests submitted at once",
            "gemm": "model's own packed projections (layer 0 + lm_head), best of 5, at the decode"
            " batch and at 16 prompts' tokens",
            "load_average_1min_before_after": [load_before[0], os.getloadavg()[0]],
        },
        metrics={
            "tokens_per_s": ours["tokens_per_s"],
            "tokens_per_s_hf_peft": best["tokens_per_s"],
            "hf_peft_best_batch_size": best["batch_size"],
            "ratio_vs_hf_peft": ours["tokens_per_s"] / best["tokens_per_s"],
            "decode_step_ms_lora": ours["decode_step_ms"],
            "decode_step_ms_base": base["decode_step_ms"],
            "decode_step_ratio_lora_vs_base": statistics.median(step_ratios),
            "rounds": {
                "tokens_per_s_lora": [r["tokens_per_s"] for r in runs["lora"]],
                "tokens_per_s_base": [r["tokens_per_s"] for r in runs["base"]],
                "decode_step_ratio_lora_vs_base": step_ratios,
                "tokens_per_s_1_thread": [r["tokens_per_s"] for r in runs["lora_1_thread"]],
                "threads_speedup": speedups,
            },
            "tokens_per_s_base_only": base["tokens_per_s"],
            "gemm_gflops": (prefill_flops + decode_flops) / roofline_s / 1e9,
            "gemm_gflops_decode_batch": gemm[args.num_requests],
            "gemm_gflops_prefill": gemm[args.prompt_len * 16],
            "roofline_fraction": roofline_s / ours["seconds"],
            "tokens_per_s_1_thread": ours_1["tokens_per_s"],
            "threads_speedup": statistics.median(speedups),
            "ttft_ms_single": single["base"]["ttft_ms"],
            "tpot_ms_single": single["base"]["tpot_ms"],
            "single": {"ours": single, "transformers": single_hf, **single_ratios},
            "startup_s": startup_s,
            "hf_peft_runs": hf_runs,
        },
    )
    print(json.dumps(result["metrics"], indent=2))


if __name__ == "__main__":
    main()
