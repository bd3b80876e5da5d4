"""Time one layer's attention over the paged KV on a GPU: the torch path (a gather into a dense
copy, then matmuls; one SDPA per prefill segment) against the Triton kernels that read the pool
in place (server/model/paged/); writes bench/results/paged_attention.json.

    python -m bench.bench_paged_attention [--dtype bfloat16] [--out FILE]

Llama-3-8B's heads (32 query heads over 8 kv heads, D = 128), every request's slots scattered
over the pool. Decode: B requests of L positions each. Mixed: a step as chunked prefill makes
it, one chunk after its earlier chunks beside decode rows after their pasts; prompts: fresh
prompts alone. Each case is timed as `--iters` calls captured in one CUDA graph (eager where the
torch path cannot be captured: `timed_in_graph`), the two paths alternating over `--repeats`
rounds; the median round and the spread (min, max) of the ratio torch / Triton are reported,
with the largest difference between the two outputs. On a GPU only.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import sys
from pathlib import Path

import torch

from bench.bench_kernels import replayer, time_us
from bench.envelope import describe_device, write_result

log = logging.getLogger("bench_paged_attention")

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DECODE = ((1, 8192), (8, 4096), (32, 2048), (64, 1024), (128, 512))  # (B, L)
MIXED = {  # name -> segments (new tokens, past)
    "chunk512_after1536_and_32_decodes_after1024": [(512, 1536)] + [(1, 1024)] * 32,
    "prompts_8x256": [(256, 0)] * 8,
}


def scattered_pool(num_slots: int, dtype, gen):
    k = torch.randn(KV_HEADS, num_slots, HEAD_DIM, generator=gen, device="cuda").to(dtype)
    v = torch.randn(KV_HEADS, num_slots, HEAD_DIM, generator=gen, device="cuda").to(dtype)
    return k, v, torch.randperm(num_slots, generator=gen, device="cuda")


def decode_case(batch: int, length: int, dtype, gen):
    k, v, perm = scattered_pool(batch * length + 1, dtype, gen)
    index = perm[: batch * length].view(batch, length)
    lengths = torch.full((batch,), length, dtype=torch.int64, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device="cuda").to(dtype)
    return q, k, v, index, lengths


def mixed_case(segments, dtype, gen):
    num_tokens = sum(t for t, _ in segments)
    k, v, perm = scattered_pool(num_tokens + sum(p for _, p in segments), dtype, gen)
    seg_starts, past_slots, used = [0], [], num_tokens
    for t, p in segments:
        seg_starts.append(seg_starts[-1] + t)
        past_slots.append(perm[used : used + p] if p else None)
        used += p
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen, device="cuda").to(dtype)
    key = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(dtype)
    val = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(dtype)
    slots = perm[:num_tokens]
    k[:, slots], v[:, slots] = key.transpose(0, 1), val.transpose(0, 1)
    return q, key, val, seg_starts, past_slots, k, v, slots


def compare(torch_fn, paged_fn, args) -> dict:
    """Both paths, captured once, alternating over the rounds: their times (per call), the
    ratio's median and spread, and the largest difference between their outputs."""
    err = (torch_fn().float() - paged_fn().float()).abs().max().item()
    runs = {"torch": replayer(torch_fn, args.iters), "triton": replayer(paged_fn, args.iters)}
    times: dict[str, list[float]] = {"torch": [], "triton": []}
    for _ in range(args.repeats):
        for name, (run, _) in runs.items():
            times[name].append(time_us(run, 1, 1) / args.iters)
    ratios = [a / b for a, b in zip(times["torch"], times["triton"])]
    return {
        "torch_us": round(statistics.median(times["torch"]), 2),
        "triton_us": round(statistics.median(times["triton"]), 2),
        "ratio_torch_vs_triton": round(statistics.median(ratios), 3),
        "ratio_spread": [round(min(ratios), 3), round(max(ratios), 3)],
        "timed_in_graph": all(graphed for _, graphed in runs.values()),
        "max_abs_diff": err,
    }


@contextlib.contextmanager
def torch_path(attention):
    """attention's dispatch as on a GPU without Triton: the gather and SDPA path."""
    saved = attention._paged
    attention._paged = lambda: None
    try:
        yield
    finally:
        attention._paged = saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/paged_attention.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        print("bench_paged_attention: timed on a CUDA GPU only; no result written.",
              file=sys.stderr)  # fmt: skip
        return 2
    from toppings.server.model import attention, paged  # imports triton: only on a GPU

    dtype, gen = getattr(torch, args.dtype), torch.Generator(device="cuda").manual_seed(0)
    metrics: dict[str, dict] = {"decode": {}, "mixed": {}}
    for batch, length in DECODE:
        q, k, v, index, lengths = decode_case(batch, length, dtype, gen)
        case = (q, k, v, index, lengths)
        result = compare(
            lambda case=case: attention._decode_torch(*case),
            lambda case=case: paged.paged_decode_attention(*case),
            args,
        )  # fmt: skip
        result["splits"] = paged.num_splits(batch, KV_HEADS, length)
        metrics["decode"][f"B{batch}_L{length}"] = result
        log.info("decode B%d L%d: %s", batch, length, result)
    for name, segments in MIXED.items():
        q, key, val, seg_starts, past_slots, k, v, slots = mixed_case(segments, dtype, gen)
        rows = attention._plan_decode_rows(seg_starts, past_slots, slots)  # the torch path's
        plan = paged.plan_paged(seg_starts, past_slots, slots, HEADS // KV_HEADS)
        common = (q, key, val, seg_starts, past_slots, k, v)

        def torch_step(common=common, rows=rows):  # decode rows batched, SDPA per segment
            with torch_path(attention):
                return attention.prefill_attention(*common, rows)

        def paged_step(q=q, k=k, v=v, plan=plan):
            return paged.paged_prefill_attention(q, k, v, plan)

        result = compare(torch_step, paged_step, args)
        metrics["mixed"][name] = result
        log.info("%s: %s", name, result)

    import triton

    write_result(
        args.out, "paged_attention", "bench_paged_attention", device=describe_device("cuda"),
        argv=argv, metrics=metrics,
        config={
            "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": args.dtype,
            "iters": args.iters, "repeats": args.repeats, "torch": torch.__version__,
            "triton": triton.__version__,
        },
    )  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
