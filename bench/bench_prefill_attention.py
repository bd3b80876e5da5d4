"""Time one layer's prefill attention on the CPU: a chunk after a long past and a whole long
prompt, through the blocked native kernel, the native rows kernel and torch's SDPA; writes
bench/results/prefill_attention.json.

SmolLM2's heads by default (9 query heads over 3 kv heads, D = 64). Each path runs `--repeats`
rounds of `--iters` calls, the paths alternating within a round; the median round is reported
(and the spread), since a shared machine's neighbours move single timings, and so is the
process's CPU time (both threads' together), which they move less.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path

import torch

from bench.envelope import describe_device, write_result
from toppings.server import native
from toppings.server.model import attention

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_case(new: int, past: int, heads: int, kv_heads: int, head_dim: int, dtype):
    """One segment of `new` tokens after `past`, its keys in scattered slots of a pool."""
    gen = torch.Generator().manual_seed(0)
    num_slots = new + past + 64
    q = torch.randn(new, heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(new, kv_heads, head_dim, generator=gen).to(dtype)
    val = torch.randn(new, kv_heads, head_dim, generator=gen).to(dtype)
    k_cache = torch.randn(kv_heads, num_slots, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, num_slots, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_slots, generator=gen)
    slots, past_slots = perm[:new], perm[new : new + past]
    k_cache[:, slots], v_cache[:, slots] = key.transpose(0, 1), val.transpose(0, 1)
    past_list = [past_slots if past else None]
    return q, key, val, [0, new], past_list, k_cache, v_cache, slots


def paths(case):
    """Name -> a call attending the case: blocked kernel, rows kernel, SDPA (whatever the
    engine's rule between the first two would pick)."""
    q, key, val, seg_starts, past, k_cache, v_cache, slots = case
    args = (q, key, val, seg_starts, past, k_cache, v_cache)
    saved = attention.TILE_MIN_LEN, attention.TILE_MIN_WORK
    try:
        attention.TILE_MIN_LEN, attention.TILE_MIN_WORK = 1, 0
        tiled = attention.plan_prefill(seg_starts, past, slots)
        attention.TILE_MIN_LEN = 1 << 30
        rows = attention.plan_prefill(seg_starts, past, slots)
    finally:
        attention.TILE_MIN_LEN, attention.TILE_MIN_WORK = saved
    return {
        "tiles": lambda: attention.prefill_attention(*args, tiled),
        "rows": lambda: attention.prefill_attention(*args, rows),
        "sdpa": lambda: attention.prefill_attention(*args),
    }


def flops(new: int, past: int, heads: int, head_dim: int) -> float:
    """Multiply-adds x 2 of the scores and the weighted values a causal segment needs."""
    keys = new * past + new * (new + 1) / 2
    return 4.0 * keys * heads * head_dim


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--cases", default="256:2300,3000:0,128:0", help="new:past,...")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/prefill_attention.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if native.library() is None:
        log.error("the native kernels could not be built here; no result written")
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    metrics: dict = {}
    with torch.inference_mode():
        for dtype_name in args.dtypes.split(","):
            for spec in args.cases.split(","):
                new, past = map(int, spec.split(":"))
                case = make_case(new, past, args.heads, args.kv_heads, args.head_dim,
                                 DTYPES[dtype_name])  # fmt: skip
                calls = paths(case)
                rounds: dict[str, list[float]] = {name: [] for name in calls}
                cpu: dict[str, list[float]] = {name: [] for name in calls}
                for call in calls.values():
                    call()  # warm-up
                for _ in range(args.repeats):
                    for name, call in calls.items():
                        start, start_cpu = time.perf_counter(), time.process_time()
                        for _ in range(args.iters):
                            call()
                        rounds[name].append(1000 * (time.perf_counter() - start) / args.iters)
                        cpu[name].append(1000 * (time.process_time() - start_cpu) / args.iters)
                work = flops(new, past, args.heads, args.head_dim)
                row = {}
                for name, times in rounds.items():
                    ms = statistics.median(times)
                    row[name] = {
                        "ms_median": round(ms, 3),
                        "ms_min": round(min(times), 3),
                        "ms_max": round(max(times), 3),
                        "gflops": round(work / ms / 1e6, 2),
                        # the process's CPU time: what the neighbours of a shared machine move less
                        "cpu_ms_median": round(statistics.median(cpu[name]), 3),
                    }
                row["tiles_speedup_vs_rows"] = round(row["rows"]["ms_median"]
                                                     / row["tiles"]["ms_median"], 2)  # fmt: skip
                row["tiles_speedup_vs_sdpa"] = round(row["sdpa"]["ms_median"]
                                                     / row["tiles"]["ms_median"], 2)  # fmt: skip
                key = f"{dtype_name}_new{new}_past{past}"
                metrics[key] = row
                log.info("%s: %s", key, "  ".join(
                    f"{n} {r['ms_median']:.2f} ms ({r['gflops']:.1f} GFLOP/s)"
                    for n, r in row.items() if isinstance(r, dict)))  # fmt: skip
    config = {
        "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
        "iters": args.iters, "repeats": args.repeats, "threads": torch.get_num_threads(),
        "layers": 1,
    }  # fmt: skip
    write_result(args.out, "prefill_attention", "bench_prefill_attention", device=describe_device(),
                 config=config, metrics=metrics, argv=argv)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
