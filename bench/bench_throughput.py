"""Output tokens/s of our engine against transformers + PEFT on the same mixed-adapter requests.

Both sides run in this process, one after the other, on the same prompts, adapters and dtype.
transformers + PEFT uses batched `generate(adapter_names=...)`; it is timed at several batch
sizes and its fastest is the baseline. Also measures our decode step with and without LoRA.

    python -m bench.bench_throughput --out bench/results/engine_throughput.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch

from bench.envelope import describe_device, write_result
from toppings.scripts.make_adapters import make_random_adapter
from toppings.server.config import EngineConfig
from toppings.server.loader import resolve_model_dir
from toppings.server.request import GenerationRequest, SamplingParams
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
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, vocab, (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.num_requests)
    ]
    names = [f"a{i % args.num_adapters}" for i in range(args.num_requests)]
    return adapters, prompts, names


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


def run_hf_peft(model_dir, adapters, prompts, names, new_tokens, batch_size, dtype, limit):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    items = list(adapters.items())
    model = PeftModel.from_pretrained(base, items[0][1], adapter_name=items[0][0])
    for name, path in items[1:]:
        model.load_adapter(path, adapter_name=name)
    model.eval()
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
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
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
    p.add_argument("--adapter-dir", default="/tmp/toppings-bench-adapters")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    p.add_argument("--out", default="bench/results/engine_throughput.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
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
    )
    engine = build_engine(str(model_dir), config, adapters)
    try:
        run_ours(engine, prompts[:8], names[:8], 8)  # warm-up
        ours = run_ours(engine, prompts, names, args.new_tokens)
        base = run_ours(engine, prompts, [None] * len(prompts), args.new_tokens)
    finally:
        engine.shutdown()
    log.info("ours: %s; base model only: %s", ours, base)
    hf_runs = []
    for bs in (int(b) for b in args.hf_batch_sizes.split(",")):
        limit = args.hf_bs1_requests if bs == 1 else args.num_requests
        hf_runs.append(
            run_hf_peft(model_dir, adapters, prompts, names, args.new_tokens, bs, dtype, limit)
        )
        log.info("transformers+peft: %s", hf_runs[-1])
    best = max(hf_runs, key=lambda r: r["tokens_per_s"])
    result = write_result(
        args.out,
        "engine_throughput",
        "bench_throughput",
        device=describe_device(),
        argv=argv,
        config={
            **{k: v for k, v in vars(args).items() if k != "out"},
            "targets": TARGETS,
            "ranks": RANKS,
            "ours": "in-process engine, all requests submitted at once",
            "load_average_1min_before_after": [load_before[0], os.getloadavg()[0]],
        },
        metrics={
            "tokens_per_s": ours["tokens_per_s"],
            "tokens_per_s_hf_peft": best["tokens_per_s"],
            "hf_peft_best_batch_size": best["batch_size"],
            "ratio_vs_hf_peft": ours["tokens_per_s"] / best["tokens_per_s"],
            "decode_step_ms_lora": ours["decode_step_ms"],
            "decode_step_ms_base": base["decode_step_ms"],
            "decode_step_ratio_lora_vs_base": ours["decode_step_ms"] / base["decode_step_ms"],
            "tokens_per_s_base_only": base["tokens_per_s"],
            "hf_peft_runs": hf_runs,
        },
    )
    print(json.dumps(result["metrics"], indent=2))


if __name__ == "__main__":
    main()
