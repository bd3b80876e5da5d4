"""A mixed step's attention plan built from spans of the request table (PastTable) against one
slice and one cat a segment, in whole engine steps; writes bench/results/mixed_plan.json.

Chunked prefill puts a long prompt's chunk beside every running decode, and a mixed step is
one segment a decode row: its attention plan (which slots each segment reads, built once a step
and read by every layer) cost a tensor slice, a `torch.cat` and a few small tensors per segment
on the host, on the CPU's native path and the GPU's Triton path alike. Since session 61 the
model runner hands the plan builders the segments as spans of the pool's request table
(server/memory/past_table.py), which they turn into the plan with a few array operations.

Both builders are live code (a list of slices still takes the per-segment path), so one engine
runs both: "slices" swaps the model runner's PastTable for a function that makes the list of
slices it replaced. For each batch size B: B requests decode beside a `--chunk`-token piece of
one long prompt (a budget of B + chunk tokens: every timed step is such a mixed step), the
median of `--steps` steps per round, rounds alternating the two kinds; the ratio spans / slices
is paired round by round. The model is the host-overhead bench's tiny Llama (2 layers, 64
wide, one head of 64 dims: its compute is nearly nothing, so the steps show the host's work)
or, with `--model`, a real checkpoint (SmolLM2: its compute dilutes the difference). Beside
them, the plan alone (`plan_prefill`) of such a step, both ways, in microseconds.

    python -m bench.bench_mixed_plan [--batches 16,64,256] [--rounds 5] [--model smollm2]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.bench_host_overhead import decode_steps_us
from bench.common import alternating
from bench.envelope import describe_device, write_result
from toppings.server.config import EngineConfig
from toppings.server.engine import model_runner
from toppings.server.engine.engine import Engine
from toppings.server.memory.past_table import PastTable
from toppings.server.model.attention import plan_prefill
from toppings.server.model.loader import load_checkpoint, resolve_model_dir

log = logging.getLogger(__name__)

KINDS = ("spans", "slices")
PAST = 100  # each decode row's past in the plan-alone timing


def slices(table: torch.Tensor, rows: list[int], starts: list[int]) -> list:
    """What the model runner gave the plan builders before PastTable: one slice a segment."""
    return [table[r, :b] if b else None for r, b in zip(rows, starts)]


def plan_alone_us(batch: int, chunk: int, kind: str, calls: int = 40) -> float:
    """Median time (us) of plan_prefill for `batch` decode rows (a past of PAST each) beside
    one `chunk`-token piece after a past of 512."""
    table = torch.arange((batch + 8) * 4096, dtype=torch.int64).reshape(batch + 8, 4096)
    rows, starts = list(range(batch + 1)), [PAST] * batch + [512]
    counts, seg = [1] * batch + [chunk], [0]
    for n in counts:
        seg.append(seg[-1] + n)
    slots = torch.cat([table[r, b : b + n] for r, b, n in zip(rows, starts, counts)])
    make = PastTable if kind == "spans" else slices
    times = []
    for i in range(calls + 5):
        started = time.perf_counter()
        plan_prefill(seg, make(table, rows, starts), slots, 1, True, 0)
        if i >= 5:  # after a few warm calls
            times.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times)


def mixed_step_us(engine: Engine, batch: int, kind: str, args) -> float:
    """Median mixed step (us) of `engine` with the model runner's plans built as `kind`."""
    model_runner.PastTable = PastTable if kind == "spans" else slices
    try:
        return statistics.median(decode_steps_us(engine, batch, args.steps, args.chunk))
    finally:
        model_runner.PastTable = PastTable


def make_engines(args, batches: list[int]) -> tuple[dict[int, Engine], Path | None]:
    """One engine per batch size, its budget B + chunk tokens (and the tiny model's dir, made
    here, to remove)."""
    scratch = None
    if args.model:
        model_dir = str(resolve_model_dir(args.model))
    else:
        from toppings.scripts.make_tiny_llama import make_tiny_llama

        scratch = Path(tempfile.mkdtemp(prefix="mixed_plan_"))
        model_dir = str(make_tiny_llama(scratch / "tiny", num_heads=1, num_kv_heads=1,
                                        max_position_embeddings=16384))  # fmt: skip
    tokens = max(batches) * 2 * (4 + args.steps + 64) + args.chunk * (args.steps + 8)
    config = EngineConfig(dtype=args.dtype, adapt_threads=False, num_threads=args.threads,
                          max_total_tokens=tokens, chunked_prefill=True)  # fmt: skip
    engines = {}
    for b in batches:
        step = dataclasses.replace(
            config, max_batch_size=b + 1, max_num_batched_tokens=b + args.chunk
        )
        engines[b] = Engine(step, load_checkpoint(model_dir, "auto"))
    return engines, scratch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="16,64,256", help="decode rows beside the chunk")
    p.add_argument("--chunk", type=int, default=256, help="prompt tokens of each mixed step")
    p.add_argument("--steps", type=int, default=16, help="mixed steps timed per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds, the order alternating")
    p.add_argument("--model", default=None, help="a checkpoint (default: the tiny Llama)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="batches 4,16, 3 steps, 1 round")
    p.add_argument("--out", default="bench/results/mixed_plan.json")
    return p.parse_args(argv)


def _spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    if args.quick:
        args.batches, args.steps, args.rounds = "4,16", 3, 1
    batches = [int(b) for b in args.batches.split(",") if b]
    engines, scratch = make_engines(args, batches)
    steps = {b: {k: [] for k in KINDS} for b in batches}
    try:
        for b, engine in engines.items():  # warm-up: both kinds once
            for kind in KINDS:
                mixed_step_us(engine, b, kind, argparse.Namespace(**{**vars(args), "steps": 2}))
        for r, kind in alternating(KINDS, args.rounds):
            for b, engine in engines.items():
                steps[b][kind].append(mixed_step_us(engine, b, kind, args))
                log.info("round %d, %s, B %d: %.0f us", r, kind, b, steps[b][kind][-1])
    finally:
        for engine in engines.values():
            engine.shutdown()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    metrics: dict = {}
    for b in batches:
        pairs = list(zip(steps[b]["spans"], steps[b]["slices"]))
        plan = {k: plan_alone_us(b, args.chunk, k) for k in KINDS}
        metrics[f"batch_{b}"] = {
            "step_us": {k: round(statistics.median(v), 1) for k, v in steps[b].items()},
            "step_ratio_spans_vs_slices": _spread([s / o for s, o in pairs]),
            "plan_us": {k: round(v, 1) for k, v in plan.items()},
            "rounds": steps[b],
        }
    last = metrics[f"batch_{batches[-1]}"]
    metrics["step_ratio_spans_vs_slices"] = last["step_ratio_spans_vs_slices"]["median"]
    config = {
        "model": args.model or "tiny Llama (2 layers, 64 wide, 1 head of 64 dims)",
        "dtype": args.dtype,
        "batches": batches,
        "chunk": args.chunk,
        "steps": args.steps,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
    }
    return write_result(args.out, "mixed_plan", "bench_mixed_plan", device=describe_device("cpu"),
                        config=config, metrics=metrics, argv=argv)  # fmt: skip


if __name__ == "__main__":
    main()
