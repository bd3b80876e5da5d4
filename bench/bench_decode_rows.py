"""Decode steps at 1-32 requests: the GEMV on AMX's tile unit against the kernels before it.

    python -m bench.bench_decode_rows [--batches 1,2,4,8,16,32] [--rounds 3]

Two engines of one model (SmolLM2, bfloat16, by default) in this process, equal but for the base
model's projections at a decode step's rows (server/model/linear.py):
- `tiles`: the engine's choice on a CPU with AMX, `gemv_bf16_tiles` (csrc/gemv_tiles.c) at 1-32
  rows, from a copy of the weights in the tile unit's layout;
- `vectors`: the kernels before it, `gemv_bf16` (avx512_bf16) at 1-4 rows and oneDNN's packed
  GEMM past 4 (the engine's choice on a CPU with avx512_bf16 and no AMX).
Each engine is driven step by step here (`Engine.step`, no engine thread, `--threads` torch
threads): B requests of 40-token prompts decode, and the steps that decode all B are timed, on
the base model and with a different adapter for each request (`--adapters` of the bench adapters
of bench_adapter_scale, ranks 8-64 on q, k, v, o; made once under `--adapter-dir`). Rounds
alternate the engines' order; reported: each engine's median step per batch (pooled over rounds,
the per-round medians beside) and `vectors / tiles` per batch.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time
from pathlib import Path

import torch

from bench.bench_adapter_scale import make_adapters
from bench.envelope import describe_device, write_result
from toppings.server.config import EngineConfig
from toppings.server.engine.engine import Engine
from toppings.server.model import linear
from toppings.server.model.loader import load_checkpoint, resolve_model_dir
from toppings.server.requests.request import GenerationRequest, SamplingParams

log = logging.getLogger(__name__)

TILES, VECTORS = "tiles", "vectors"
PROMPT_TOKENS = 40
# bench_adapter_scale's adapters (made there once when missing)
ADAPTER_DIR = Path.home() / ".cache/toppings/bench_adapters/smollm2-qkvo-1024"


@contextlib.contextmanager
def without_tiles():
    """Engines built inside choose among the kernels before the tiles' (their Linears keep the
    kernel they were built with)."""
    table = linear._GEMV
    linear._GEMV = {d: tuple(k for k in ks if not k.tiled) for d, ks in table.items()}
    linear.gemv_kernel.cache_clear()
    try:
        yield
    finally:
        linear._GEMV = table
        linear.gemv_kernel.cache_clear()


def make_engine(checkpoint, args, adapter_dir: Path, names: list[str], tiles: bool) -> Engine:
    config = EngineConfig(dtype="bfloat16", max_batch_size=max(args.batches),
                          max_total_tokens=max(args.batches) * 512, lora_mode="cached",
                          adapter_cache_bytes=args.adapters * 16_000_000)  # fmt: skip
    with contextlib.nullcontext() if tiles else without_tiles():
        engine = Engine(config, checkpoint)
    for name in names:
        engine.add_adapter(name, str(adapter_dir / name))
    return engine


def decode_steps(engine: Engine, adapters: list, steps: int, seed: int) -> list[float]:
    """Step times (ms) of `steps` decode steps of len(adapters) requests, after their prefill."""
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_new_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    handles = [
        engine.submit(GenerationRequest(
            torch.randint(100, 40000, (PROMPT_TOKENS,), generator=gen).tolist(), params,
            adapter=a,
        ))
        for a in adapters
    ]  # fmt: skip
    times: list[float] = []
    while len(times) < steps:
        start = time.perf_counter()
        plan = engine.step()
        if plan is not None and not plan.is_prefill and len(plan.seqs) == len(adapters):
            times.append(1000 * (time.perf_counter() - start))
    for h in handles:
        h.abort()
    while engine.scheduler.has_work():
        engine.step()
    return times


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batches", default="1,2,4,8,16,32")
    p.add_argument("--adapters", type=int, default=8, help="distinct adapters (0: base only)")
    p.add_argument("--adapter-dir", type=Path, default=ADAPTER_DIR)
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per batch")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench/results/decode_rows.json")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model_dir(args.model))
    kernel = linear.gemv_kernel(torch.bfloat16)
    if kernel is None or not kernel.tiled:
        raise SystemExit(f"the tiles' GEMV does not run here (bf16 GEMV: {kernel}): no AMX")
    names = sorted(make_adapters(args.adapter_dir, model_dir, 1024))[: args.adapters]
    checkpoint = load_checkpoint(model_dir)
    engines = {e: make_engine(checkpoint, args, args.adapter_dir, names, e == TILES)
               for e in (TILES, VECTORS)}  # fmt: skip
    refs = {e: [engine.resolve_adapter(n) for n in names] for e, engine in engines.items()}
    cases = {"base": lambda e, b: [None] * b}
    if names:
        cases["adapters"] = lambda e, b: [refs[e][i % len(names)] for i in range(b)]
    times = {(e, c, b): [] for e in engines for c in cases for b in args.batches}
    per_round = {key: [] for key in times}
    for rnd in range(args.rounds):
        order = list(engines) if rnd % 2 == 0 else list(engines)[::-1]
        for case, adapters_of in cases.items():
            for batch in args.batches:
                for name in order:
                    got = decode_steps(engines[name], adapters_of(name, batch), args.steps, rnd)
                    times[name, case, batch] += got
                    per_round[name, case, batch].append(statistics.median(got))
        log.info("round %d done", rnd)
    metrics: dict = {}
    for case in cases:
        for batch in args.batches:
            med = {e: statistics.median(times[e, case, batch]) for e in engines}
            metrics[f"{case}_b{batch}"] = {
                "tiles_ms": med[TILES], "vectors_ms": med[VECTORS],
                "vectors_over_tiles": med[VECTORS] / med[TILES],
                "tiles_ms_per_round": per_round[TILES, case, batch],
                "vectors_ms_per_round": per_round[VECTORS, case, batch],
            }  # fmt: skip
            log.info("%s B=%d: tiles %.1f ms, vectors %.1f ms (x%.2f)", case, batch, med[TILES],
                     med[VECTORS], med[VECTORS] / med[TILES])  # fmt: skip
    config = {**vars(args), "adapter_dir": str(args.adapter_dir), "adapter_names": names,
              "model_dir": model_dir, "prompt_tokens": PROMPT_TOKENS}  # fmt: skip
    write_result(args.out, "decode_rows", "bench_decode_rows", device=describe_device(),
                 argv=argv, config=config, metrics=metrics)  # fmt: skip
    return metrics


if __name__ == "__main__":
    main()
