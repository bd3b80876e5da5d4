"""Base-model steps on a CPU with oneDNN-packed projections against plain `F.linear`.

    python -m bench.bench_cpu_linear --out bench/results/cpu_linear.json

Two copies of the same model (SmolLM2 by default), one with `pack_cpu_weights=True` (the
engine's default, model/linear.py) and one without, run the same decode steps (B requests with
a 128-token context) and a 128-token prefill, the two alternating call by call; reported are the
median step times and their ratio (plain / packed, above 1 means packing is faster), per dtype.
No LoRA: this is the base model's share of every step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.envelope import describe_device, write_result
from toppings.server.memory.kv_cache import KVPool
from toppings.server.model.llama import ForwardBatch, LlamaModel
from toppings.server.model.loader import load_checkpoint

CONTEXT = 128


def decode_batch(kv: KVPool, rows: list[int]) -> ForwardBatch:
    """One decode step of len(rows) requests; their KV rows grow by one slot each."""
    b = len(rows)
    slots = kv.extend_each(rows)
    index, lengths = kv.decode_index(rows)
    positions = torch.tensor([kv.lengths[r] - 1 for r in rows])
    return ForwardBatch(torch.zeros(b, dtype=torch.int64), positions, slots,
                        list(range(b + 1)), False, index, lengths)  # fmt: skip


def prefill_batch(kv: KVPool, row: int, tokens: int) -> ForwardBatch:
    slots = kv.extend(row, tokens)
    return ForwardBatch(torch.arange(tokens) % 1000, torch.arange(tokens), slots, [0, tokens], True)


def compare(models: dict[str, LlamaModel], kv: KVPool, batch: int | None, calls: int) -> dict:
    """Median ms of each model on the same step (decode of `batch` requests, or a prefill)."""
    rows = [kv.new_row() for _ in range(batch or 1)]
    try:
        for row in rows:
            kv.extend(row, CONTEXT)
        step = prefill_batch(kv, rows[0], CONTEXT) if batch is None else decode_batch(kv, rows)
        times: dict[str, list[float]] = {n: [] for n in models}
        for i in range(calls + 2):
            for name, model in models.items():
                start = time.perf_counter()
                model.forward(step, kv)
                if i >= 2:
                    times[name].append((time.perf_counter() - start) * 1e3)
    finally:
        for row in rows:
            kv.free_row(row)
    medians = {f"{n}_ms": statistics.median(t) for n, t in times.items()}
    return {**medians, "ratio_plain_vs_packed": medians["plain_ms"] / medians["packed_ms"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default="bench/results/cpu_linear.json")
    args = p.parse_args(argv)
    checkpoint = load_checkpoint(args.model)
    cfg = checkpoint.config
    batches = [int(b) for b in args.batches.split(",")]
    results = {}
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        models = {
            "packed": LlamaModel(cfg, checkpoint.weights, dtype, "cpu", 1024, True),
            "plain": LlamaModel(cfg, checkpoint.weights, dtype, "cpu", 1024, False),
        }
        assert models["packed"].layers[0].qkv.is_packed, "oneDNN packing is not available here"
        kv = KVPool(cfg.num_layers, (CONTEXT + args.calls + 8) * max(batches) + 64,
                    cfg.num_kv_heads, cfg.head_dim, max(batches), 1024, dtype)  # fmt: skip
        runs = {f"decode_b{b}": compare(models, kv, b, args.calls) for b in batches}
        runs[f"prefill_{CONTEXT}"] = compare(models, kv, None, args.calls)
        for name, run in runs.items():
            print(f"{dtype_name} {name}: packed {run['packed_ms']:.1f} ms, plain "
                  f"{run['plain_ms']:.1f} ms, {run['ratio_plain_vs_packed']:.2f}x")  # fmt: skip
        results[dtype_name] = runs
    write_result(
        args.out,
        "cpu_linear",
        "bench_cpu_linear",
        device=describe_device(),
        argv=argv,
        config={
            "model": args.model,
            "context": CONTEXT,
            "calls": args.calls,
            "batches": batches,
        },
        metrics={
            "decode_speedup_packed_vs_plain": {
                d: {str(b): r[f"decode_b{b}"]["ratio_plain_vs_packed"] for b in batches}
                for d, r in results.items()
            },
            "prefill_speedup_packed_vs_plain": {
                d: r[f"prefill_{CONTEXT}"]["ratio_plain_vs_packed"] for d, r in results.items()
            },
            "runs": results,
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
