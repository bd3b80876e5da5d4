"""The engine loop's host time per decode step, with a forward pass that costs nothing; writes
bench/results/host_overhead.json.

On a GPU the device runs a decode step of an 8B model in a few milliseconds; everything the host
does around it (schedule, build the step's inputs, sample, update each request, detokenize and
stream) is on the critical path while the loop is synchronous (issue 63). This bench measures
that host time on a model that computes nearly nothing: a tiny Llama (2 layers, 64 wide, one
head of 64 dims) with its own forward ("real": the forward's Python and kernel calls are host
work too); the same engine with the forward replaced by one that returns zero logits at once
("none": the loop alone); and the same again with its decode steps through the CUDA-graph path
("graph": `DecodeGraphs` fills its step buffers from the decode rows and replays a stand-in
graph that computes nothing: the host side of a GPU's graphed decode step, on a CPU); and
mixed steps ("mixed": forward as "none", the B decodes beside a `--chunk`-token piece of one long
prompt under a budget of B + chunk tokens, an engine per B: its slope is what each decode row of
a mixed step costs the host, where chunked prefill puts most steps under load). Each
engine is driven step by step on this thread (no engine thread); for each batch size B, B
requests are admitted and prefilled, then `--steps` decode steps are timed one by one.
Rounds alternate the order of the (forward, batch) runs; per run the median step is kept.

The one head keeps attention on the native kernel's path for the head dims models have (64,
128): the tiny model's default four heads of 16 dims take its generic path, whose arithmetic
over 256 requests' contexts is no longer nothing (about 0.75 ms a layer on one EPYC core at
batch 256 against 0.12 ms for one head of 64: `--heads 4` measures that shape).

Reported per forward: the median step (us) per batch size with its spread over rounds, and the
least-squares line through them, `host_fixed_us` + `host_us_per_request` x B; the top-level
pair is the "real" one (issue 63's bound: <= 150 us fixed, <= 10 us per request).

    python -m bench.bench_host_overhead [--batches 1,64,256] [--steps 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.common import add_output_thread_flag, output_thread_setting
from bench.envelope import describe_device, write_result
from toppings.server.config import EngineConfig
from toppings.server.engine.engine import Engine
from toppings.server.model.cuda_graphs import DecodeGraphs
from toppings.server.model.graph_buckets import GraphBuckets
from toppings.server.model.loader import load_checkpoint
from toppings.server.process.gc_heap import freeze_startup_heap, thaw_heap
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.sched.step_budget import GEMM_TOKENS

log = logging.getLogger(__name__)

PROMPT = [5, 6, 7, 8]
# the tiny model's own forward; one returning zero logits at once; decode by a free graph
FORWARDS = ("real", "none", "graph")
_PROMPTS = itertools.count()  # the first token of each mixed run's long prompt


class FreeGraphs(DecodeGraphs):
    """The decode graphs' host side on a CPU: buckets, pointer checks and the step's buffers
    filled as on a GPU, each bucket's 'graph' a replay that computes nothing."""

    def _record(self, key):
        graph = self._graphs[key] = SimpleNamespace(replay=lambda: None)
        return graph


def free_graphs(engine: Engine) -> None:
    """Decode steps of `engine` through `FreeGraphs` (prefill steps run its model)."""
    buckets = GraphBuckets.for_engine(engine.config.max_batch_size, engine.kv.max_len)
    lora = engine.lora
    engine.runner.graphs = FreeGraphs(engine.model, engine.kv, lora.pool,
                                      lora.steps.kernels.decode, buckets)  # fmt: skip


def free_forward(model) -> None:
    """Replace `model.forward` by one that returns zero logits [R, V] at once (R: the rows the
    step asks for), leaving everything around it as it runs."""
    vocab = model.config.vocab_size

    def forward(batch, kv):
        rows = len(batch.seg_starts) - 1 if batch.logit_rows is None else len(batch.logit_rows)
        return torch.zeros(rows, vocab), None

    model.forward = forward


def drive_until(engine: Engine, done, deadline_s: float = 120.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not done():
        if time.monotonic() > deadline:
            sched = engine.scheduler
            state = f"{len(sched.running)} running, {len(sched.queue)} queued"
            raise TimeoutError(f"the engine did not get there in {deadline_s:.0f} s: {state}")
        engine.step()


def decode_steps_us(engine: Engine, batch: int, steps: int, chunk: int = 0) -> list[float]:
    """Wall time (us) of `steps` decode steps of `batch` requests, each request admitted and
    prefilled first (64 tokens to spare, so that none ends before its last timed step); then
    aborted. chunk > 0: mixed steps instead, the `batch` decodes beside a `chunk`-token piece
    of one long prompt each (the engine's step budget must be batch + chunk tokens)."""
    params = SamplingParams(max_new_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    requests = [GenerationRequest(list(PROMPT), params, None) for _ in range(batch)]
    for request in requests:
        engine.submit(request)
    sched = engine.scheduler
    drive_until(engine, lambda: len(sched.running) == batch and not sched.queue
                and all(s.output_ids for s in sched.running))  # fmt: skip
    if chunk:
        first = next(_PROMPTS)  # a prompt of its own: none of it in the prefix cache
        prompt = [5 + (first + i) % 200 for i in range(chunk * (steps + 2))]
        requests.append(GenerationRequest(prompt, params, None))
        engine.submit(requests[-1])
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        plan = engine.step()
        times.append((time.perf_counter() - started) * 1e6)
        assert plan is not None and plan.is_prefill == bool(chunk)
        assert len(plan.seqs) == batch + bool(chunk) and sum(plan.tokens) == batch + chunk
    for request in requests:
        engine.abort(request.request_id)
    drive_until(engine, lambda: not sched.has_work())
    return times


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (B, us) points."""
    if len(points) < 2:
        return points[0][1], 0.0
    fit = statistics.linear_regression([b for b, _ in points], [us for _, us in points])
    return fit.intercept, fit.slope


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,64,256", help="batch sizes, comma-separated")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    p.add_argument("--rounds", type=int, default=5, help="rounds, the batch order alternating")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--heads",
        type=int,
        default=1,
        help="attention heads of the 64-wide model (kv heads: half, at least 1)",
    )
    add_output_thread_flag(p)
    p.add_argument(
        "--chunk",
        type=int,
        default=GEMM_TOKENS,  # the budget's floor beside a few decodes: every B gets the same
        help="prompt tokens beside the decodes of a mixed step",
    )
    p.add_argument("--quick", action="store_true", help="batches 1,8, 4 steps, 1 round")
    p.add_argument("--out", default="bench/results/host_overhead.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    if args.quick:
        args.batches, args.steps, args.rounds = "1,8", 4, 1
    batches = [int(b) for b in args.batches.split(",") if b]
    from toppings.scripts.make_tiny_llama import make_tiny_llama

    model_dir = make_tiny_llama(
        Path(tempfile.mkdtemp(prefix="host_overhead_")) / "tiny",
        num_heads=args.heads,
        num_kv_heads=max(1, args.heads // 2),
        max_position_embeddings=16384,  # room for the mixed steps' long prompt
    )
    tokens = max(batches) * 2 * (len(PROMPT) + args.steps + 64)  # room past block rounding
    output_thread = output_thread_setting(args.output_thread)
    config = EngineConfig(dtype="float32", max_batch_size=max(batches), adapt_threads=False,
                          num_threads=args.threads, max_total_tokens=tokens,
                          output_thread=output_thread)  # fmt: skip
    engines = {}
    for forward in FORWARDS:
        engines[forward] = Engine(config, load_checkpoint(str(model_dir), "auto"))
        if forward == "none":
            free_forward(engines[forward].model)
        elif forward == "graph":
            free_graphs(engines[forward])
    for b in batches:  # mixed steps: a budget of b decodes and one chunk
        mixed = dataclasses.replace(
            config,
            max_batch_size=b + 1,
            chunked_prefill=True,
            max_num_batched_tokens=b + args.chunk,
            max_total_tokens=tokens + args.chunk * (args.steps + 8),
        )
        engines[("mixed", b)] = Engine(mixed, load_checkpoint(str(model_dir), "auto"))
        free_forward(engines[("mixed", b)].model)
    freeze_startup_heap()  # as toppings-serve does once built (server/process/gc_heap.py)
    runs = (*FORWARDS, "mixed")
    medians = {f: {b: [] for b in batches} for f in runs}
    try:
        for name, engine in engines.items():
            warm = batches[0] if name in FORWARDS else name[1]
            decode_steps_us(engine, warm, 2, 0 if name in FORWARDS else args.chunk)  # warm-up
        for round_idx in range(args.rounds):
            order = [(f, b) for f in runs for b in batches]
            for forward, batch in order if round_idx % 2 == 0 else order[::-1]:
                engine = engines[forward] if forward != "mixed" else engines[(forward, batch)]
                chunk = args.chunk if forward == "mixed" else 0
                median = statistics.median(decode_steps_us(engine, batch, args.steps, chunk))
                medians[forward][batch].append(median)
                log.info("round %d, forward %s, batch %d: median step %.0f us", round_idx,
                         forward, batch, median)  # fmt: skip
    finally:
        for engine in engines.values():
            engine.shutdown()
        thaw_heap()
        shutil.rmtree(model_dir.parent, ignore_errors=True)  # the tiny model's scratch dir
    metrics = {}
    for forward, by_batch in medians.items():
        fixed, per_request = fit_line([(b, statistics.median(m)) for b, m in by_batch.items()])
        metrics[forward] = {
            "host_fixed_us": round(fixed, 1),
            "host_us_per_request": round(per_request, 2),
            "per_batch": {
                str(b): {"step_us": statistics.median(m), "min": min(m), "max": max(m), "rounds": m}
                for b, m in by_batch.items()
            },  # fmt: skip
        }
        log.info("forward %s: %.0f us + %.1f us per request a decode step", forward, fixed,
                 per_request)  # fmt: skip
    # The headline: the loop and the forward's own host code on a model that computes nearly
    # nothing (what issue 63 measured); "none" is the loop alone, without the model's code.
    metrics["host_fixed_us"] = metrics["real"]["host_fixed_us"]
    metrics["host_us_per_request"] = metrics["real"]["host_us_per_request"]
    return write_result(args.out, "host_overhead", "bench_host_overhead",
                        device=describe_device("cpu"),
                        config={"batches": batches, "steps": args.steps, "rounds": args.rounds,
                                "model": f"tiny Llama (2 layers, 64 wide, {args.heads} heads of "
                                         f"{64 // args.heads} dims, vocab 256)",
                                "forwards": {"real": "its own forward (compute nearly nothing)",
                                             "none": "forward replaced by zero logits",
                                             "graph": "decode by a CUDA-graph stand-in that "
                                                      "computes nothing",
                                             "mixed": f"steps of the batch's decodes beside a "
                                                      f"{args.chunk}-token prompt chunk, forward "
                                                      f"as none"},
                                "chunk": args.chunk,
                                "threads": torch.get_num_threads(),
                                "output_thread": args.output_thread},
                        metrics=metrics, argv=argv)  # fmt: skip


if __name__ == "__main__":
    main()
