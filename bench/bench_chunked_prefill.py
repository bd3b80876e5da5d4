"""Chunked prefill (`--chunked-prefill on`) against whole-prompt prefill steps on SmolLM2, side
by side: inter-token latency, TTFT and throughput on the queueing trace with long prompts.

The workload is bench_queueing's trace (PEFT adapters of ranks 8-128 on q, k, v, equal rank
shares and Zipf popularity within a rank, LMSYS-shaped lengths, Poisson arrivals) with a share
of its requests (`--long-share`) given prompts of `--long-prompt-len` tokens: without chunking,
the step that prefills such a prompt is one long step, and every running stream waits for it
between two of its tokens. Two in-process engines are built from EngineConfigs that differ only
in `chunked_prefill` (the chunked one's step budget is the engine's own choice unless
`--max-num-batched-tokens` or `--itl-target-ms` is given; its start-up log line is recorded);
`--itl-targets` adds chunked engines sized for other inter-token targets, and `--gemm-floors`
ones whose GEMM floor is another number of tokens (smaller or larger chunks beside the streams),
run beside them, to show what each trades (`target_sweep`, with the per-load and per-round
ratios). Each engine's thread-governor changes are recorded by round.
At the start of the run (bench_queueing's rules):
- the SLO is 5x the mean E2E latency of requests of this trace served alone (unchunked);
- capacity is the request rate the unchunked engine completes a burst at while the burst still
  saturates it; the chunked engine's burst capacity is recorded beside it;
then at each of `--loads` (fractions of that capacity) both engines run the same trace, one
after the other, in alternating order over `--rounds` (a new trace per round).

Inter-token latency: each output's time is taken in the engine's thread when it is put on the
request's handle (the handle's `on_put` hook), so a reader's lag does not enter. The gaps are
between consecutive outputs that carry new tokens; the gap before an output of k tokens counts
as k gaps of gap/k; the first output's tokens have no gap (that is TTFT). P50/P99 ITL pooled
over requests and rounds, with the per-round P99s for the spread. The headlines are
chunked/unchunked, each the worst over the loads (`ratios_per_load` has each load's):
`ttft_p99_ratio`, `itl_p50_ratio` (median gap), `itl_p99_ratio`, `itl_max_ratio` (the largest
gap, pooled over rounds; the per-round largest gaps give its spread) and `throughput_ratio`
(output tokens/s, the lowest; below both engines' capacity it is near 1 by construction, as both
finish the same trace), and `capacity_ratio`, the two burst capacities. The SLO knee (the
highest load at which the unchunked engine's P99 TTFT is within the SLO) is recorded.
`ttft_p99_ratio`'s floor: each request waits at least its own prompt's prefill served alone
(measured at start-up at a few lengths on both engines, the base model; no prompt of this trace
shares a prefix with another), so no scheduler's P99 TTFT at a load is below the P99 of those
alone times; `ttft_p99_floor_ratio_per_load` is that floor over the unchunked P99.

With `--llama-server` (and `--llama-gguf`, of the engines' precision) llama.cpp's server is a
third arm in the same alternating rounds on the same traces (bench/llama_replay.py): its default
batch sizes (-b 2048, -ub 512), as many slots as `--max-batch-size`, one KV pool of
`--llama-ctx` tokens; the base model (it serves no adapter), timed by the client over HTTP.
`*_vs_llama_server` are the chunked engine's ratios to it, the worst over the loads; their TTFT
is to the first text on both sides (`ttft_text_p99_ms`): llama-server holds back a token whose
text ends in an incomplete UTF-8 sequence, as the trace's prompts of byte tokens make the
first token's often are (the engines' own `ttft_p99_ms` is to the first token).

    python -m bench.bench_chunked_prefill [--loads 0.5,0.7,0.9 --duration 60 --rounds 2]
    python -m bench.bench_chunked_prefill --loads 0.3,0.5,0.7 --duration 40 --dtype bfloat16 \
        --llama-server /work/llama-build/build/bin/llama-server
    python -m bench.bench_chunked_prefill --quick --out /tmp/chunked_prefill_quick.json

Time: the full run should take 15-20 minutes on 2 quiet cores, within the 25 asked for. A load
point is `--duration` of arrivals plus the drain of what is still queued (under ~20 s up to 0.9
of capacity), once per engine: 3 loads x 2 rounds x 2 engines x 60-80 s = 12-16 min, plus the
SLO (8 requests alone), the two 32-request bursts and loading (~2-3 min). The `--quick` run
(`--duration 15`, one load, one round) took 2.6-2.8 min of wall time but only 55 s of CPU time on
this 2-core VM at load averages of 5-10 with `nice -n 19`; alone on the cores it is about 1-1.5
min (30 s of it the two 15 s arrival windows). `--dtype auto` measures the machine at start-up (the
driver resolves it once, for both engines): on the busy VM it picked float32 in one run (bfloat16
measured 1.02-1.09x) and bfloat16 in another (0.54x).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path

from bench.bench_long_prompt import llama_version, start_llama_server
from bench.bench_queueing import (
    burst_capacity,
    make_adapters,
    slo_ms_alone,
    submit_trace,
    summarise,
    trace_for,
)
from bench.common import free_port
from bench.envelope import describe_device, write_result
from bench.llama_replay import replay_llama, stream_one
from toppings.scripts.children import stop, wait_healthy
from toppings.scripts.loadgen.stats import percentile
from toppings.scripts.loadgen.workload import LengthSpec, TraceEntry
from toppings.server.config import DTYPE_CHOICES, QUEUE_POLICIES, EngineConfig
from toppings.server.engine.engine import Engine
from toppings.server.model.loader import resolve_model_dir
from toppings.server.requests.request import (
    RequestHandle,
    RequestOutput,
)
from toppings.server.runtime import build_engine

log = logging.getLogger("bench_chunked_prefill")
QUICK = {"loads": "0.9", "rounds": 1, "duration": 15.0, "per_rank": 1, "alone": 2, "burst": 6}


UNCHUNKED, CHUNKED = "unchunked", "chunked"  # the two engines of the headline ratios
BUDGET_LOGGER = "toppings.server.sched.step_budget_keeper"  # its start-up line
LLAMA = "llama-server"  # llama.cpp's server on the same trace (--llama-server)
# ratio -> whether a larger one is worse (the top-level ratio is the worst over the loads)
WORSE_IF_LARGER = {"itl_p99_ratio": True, "itl_max_ratio": True, "ttft_p99_ratio": True,
                   "throughput_ratio": False, "itl_p50_ratio": True}  # fmt: skip


def target_mode(itl_target_ms: float) -> str:
    """The name of a chunked engine sized for another inter-token target (`--itl-targets`)."""
    return f"chunked-itl{itl_target_ms:g}ms"


def floor_mode(tokens: int) -> str:
    """The name of a chunked engine with another GEMM floor (`--gemm-floors`)."""
    return f"chunked-floor{tokens}"


def mix_long_prompts(
    trace: list[TraceEntry], share: float, length: LengthSpec, seed: int
) -> list[TraceEntry]:
    """`trace` with round(share * len) of its requests (at least one when share > 0), picked
    at random, given prompts of `length` tokens drawn like the trace's own (ids in [100, 250));
    the others unchanged. Seeded: the same arguments give the same trace."""
    if share <= 0 or not trace:
        return list(trace)
    rng = random.Random(f"{seed}/long")
    num = min(len(trace), max(1, round(share * len(trace))))
    picked = set(rng.sample(range(len(trace)), num))
    return [
        dataclasses.replace(e, prompt=[rng.randrange(100, 250) for _ in range(length.sample(rng))])
        if i in picked
        else e
        for i, e in enumerate(trace)
    ]


def token_gaps(times: Sequence[float], counts: Sequence[int]) -> list[float]:
    """Inter-token gaps (s) of one stream: output i came at `times[i]` with `counts[i]` new
    tokens. Outputs without tokens are skipped; the gap before an output of k tokens counts as
    k gaps of gap/k; the first output with tokens has no gap before it (TTFT)."""
    gaps: list[float] = []
    last = None
    for when, num in zip(times, counts):
        if num <= 0:
            continue
        if last is not None:
            gaps += [(when - last) / num] * num
        last = when
    return gaps


def slo_knee(p99s: Sequence[float], slo_ms: float) -> tuple[int, bool]:
    """The index of the highest load whose P99 TTFT is within the SLO, and True; (0, False)
    when no load is (the headlines are then at the lowest load)."""
    within = [i for i, v in enumerate(p99s) if v <= slo_ms]
    return (within[-1], True) if within else (0, False)


def alone_ttft_ms(engines: dict[str, Engine], lengths: Sequence[int], seed: int) -> dict:
    """{prompt length: the least TTFT (ms) any of `engines` gives a prompt of it served alone},
    the base model, one new token, each measured twice and the faster kept (a new prompt each
    time: a repeated one would find its prefix cached)."""
    rng, best = random.Random(seed), {}

    def ttft_ms(engine: Engine, n: int) -> float:
        entry = TraceEntry(0, 0.0, None, 0, [rng.randrange(100, 250) for _ in range(n)], 1)
        return 1000 * replay_timed(engine, [entry], burst=True)[0]["ttft_s"]

    for n in lengths:
        best[n] = min(ttft_ms(e, n) for e in engines.values() for _ in range(2))
    return best


def ttft_floor(alone_ms: dict[int, float], prompt_lens: Sequence[int]) -> float:
    """A lower bound of the P99 TTFT of requests of `prompt_lens`: each request's TTFT is at
    least its prompt's alone, which is at least that of the longest measured length not above
    it (`alone_ms`; 0 below them all); the k-th longest TTFT is then at least the k-th longest
    of those bounds."""
    points = sorted(alone_ms.items())

    def floor(n: int) -> float:
        return max((ms for length, ms in points if length <= n), default=0.0)

    return percentile([floor(n) for n in prompt_lens], 99)


class OutputClock:
    """When each output of one request was put, timed in the engine's thread through the
    handle's `on_put` hook (the hook RequestGroup uses to wake its reader)."""

    def __init__(self, handle: RequestHandle):
        self.handle = handle
        self.times: list[float] = []
        handle.on_put = self._stamp

    def _stamp(self) -> None:
        self.times.append(time.monotonic())

    def finish(self, timeout_s: float) -> tuple[RequestOutput, list[float], int, float | None]:
        """Wait for the end: the final output, the token gaps, how many outputs came before
        the hook was attached (untimed, left out of the gaps; 0 in practice, since the first
        output needs a step), and the seconds from the first timed output to the first with
        text (None: none had any)."""
        outs = list(self.handle.events(timeout_s))
        untimed = len(outs) - len(self.times)
        timed = outs[untimed:]
        gaps = token_gaps(self.times, [len(o.new_token_ids) for o in timed])
        texts = [t for t, o in zip(self.times, timed) if o.new_text]
        to_text = texts[0] - self.times[0] if texts else None
        return outs[-1], gaps, untimed, to_text


def replay_timed(engine: Engine, trace: list[TraceEntry], burst: bool = False) -> list[dict]:
    """bench_queueing.replay's records (TTFT, E2E, tokens, rank, size, span) plus each
    request's token gaps (`gaps_s`), whether its prompt is a long one, and untimed outputs."""
    start = time.monotonic()
    governor = engine.governor
    switches = governor.switches if governor is not None else 0
    clocks = submit_trace(engine, trace, burst, wrap=OutputClock)
    records = []
    for e, clock in zip(trace, clocks):
        final, gaps, untimed, to_text = clock.finish(timeout_s=3600)
        text_s = None if to_text is None or final.ttft_s is None else final.ttft_s + to_text
        records.append({"ttft_s": final.ttft_s, "ttft_text_s": text_s, "e2e_s": final.e2e_s,
                        "tokens": final.output_tokens, "rank": e.rank,
                        "size": len(e.prompt) + e.max_tokens, "prompt_len": len(e.prompt),
                        "gaps_s": gaps, "untimed": untimed})  # fmt: skip
    span = time.monotonic() - start
    # the thread governor's changes of its thread count during the run, and its count after
    flips = governor.switches - switches if governor is not None else 0
    threads = governor.chosen if governor is not None else None
    for r in records:
        r.update(span_s=span, governor_switches=flips, governor_threads=threads)
    return records


def summarise_itl(runs: list[list[dict]], long_min: int) -> dict:
    """summarise's row plus ITL (ms, pooled and per round) and P99 TTFT of the short and long
    prompts (long: at least `long_min` tokens)."""
    records = [r for run in runs for r in run]
    gaps = [1000 * g for r in records for g in r["gaps_s"]]
    ttft = {
        kind: [1000 * r["ttft_s"] for r in records if (r["prompt_len"] >= long_min) == is_long]
        for kind, is_long in (("short", False), ("long", True))
    }
    texts = [1000 * r["ttft_text_s"] for r in records if r.get("ttft_text_s") is not None]
    return {
        # to the first output with text: what llama-server's first event times (it holds a
        # token whose text is an incomplete UTF-8 sequence), so the two are compared on it
        "ttft_text_p99_ms": percentile(texts, 99) if texts else None,
        "itl_p50_ms": percentile(gaps, 50),
        "itl_p99_ms": percentile(gaps, 99),
        "itl_max_ms": max(gaps, default=math.nan),
        "itl_p99_ms_per_round": [
            percentile([1000 * g for r in run for g in r["gaps_s"]], 99) for run in runs
        ],
        "itl_max_ms_per_round": [
            max((1000 * g for r in run for g in r["gaps_s"]), default=math.nan) for run in runs
        ],
        "num_gaps": len(gaps),
        "ttft_p99_ms_short_prompts": percentile(ttft["short"], 99) if ttft["short"] else None,
        "ttft_p99_ms_long_prompts": percentile(ttft["long"], 99) if ttft["long"] else None,
        "num_long_prompts": len(ttft["long"]),
        "untimed_outputs": sum(r["untimed"] for r in records),
        # the engine's thread governor by round: its changes of thread count, its count after
        "governor_switches_per_round": [run[0].get("governor_switches") for run in runs if run],
        "governor_threads_per_round": [run[0].get("governor_threads") for run in runs if run],
    }


class StartupLog(logging.Handler):
    """Keeps the engine's start-up line about its step budget."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("chunked prefill"):
            self.lines.append(record.getMessage())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: " + str(QUICK))
    p.add_argument("--loads", default="0.5,0.7,0.9", help="fractions of unchunked capacity")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--per-rank", type=int, default=4, help="adapters per rank")
    p.add_argument("--long-share", type=float, default=0.1, help="share of long prompts")
    p.add_argument("--long-prompt-len", default="uniform:2000:3000", help="a length spec")
    p.add_argument("--max-prompt-len", type=int, default=512, help="of the other prompts")
    p.add_argument("--output-len", default="lognormal:40:1.0")
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--max-total-tokens", type=int, default=8192, help="the KV budget")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--model", default="smollm2", help="what toppings-serve --model takes")
    p.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),
        help="dummy: random weights of the checkpoint's shapes (a GPU's real sizes)",
    )
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-prefill-tokens", type=int, default=8192)
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: the engine's")
    p.add_argument("--itl-target-ms", type=float, default=None,
                   help="of the chunked engine (default: the engine's default)")  # fmt: skip
    p.add_argument("--queue-policy", default="fcfs", choices=QUEUE_POLICIES,
                   help="of every engine (the SLO knee is FCFS's)")  # fmt: skip
    p.add_argument(
        "--itl-targets",
        type=lambda v: [float(x) for x in v.split(",") if x],
        default=[],
        help="more chunked engines sized for these inter-token targets (ms, comma list), run "
        "beside the others (their ratios: target_sweep)",
    )
    p.add_argument(
        "--gemm-floors",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[],
        help="more chunked engines whose GEMM floor is this many tokens beside any number of "
        "decodes in place of the measured one (--chunk-floor-tokens; comma list), run beside "
        "the others (their ratios: target_sweep): what smaller or larger chunks trade",
    )
    p.add_argument("--llama-server", type=Path, default=None,
                   help="llama.cpp's llama-server binary: an arm on the same trace")  # fmt: skip
    p.add_argument("--llama-gguf", type=Path,
                   default=Path("/work/llama-build/SmolLM2-135M-Instruct-bf16.gguf"),
                   help="its GGUF, of the engines' precision (bench/README.md)")  # fmt: skip
    p.add_argument(
        "--llama-slots",
        type=int,
        default=None,
        help="its -np (default --max-batch-size, as many streams as the engines)",
    )
    p.add_argument("--llama-ctx", type=int, default=16384,
                   help="its -c, one KV for all slots (-kvu); more than the engines' KV, so that "
                   "no request of the trace is refused for room")  # fmt: skip
    p.add_argument("--threads", default="1,2",
                   help="llama-server's -t and -tb; a comma list: each is timed on one request "
                   "(500 prompt tokens, 16 new) and the fastest kept (on a shared 2-core VM "
                   "its 2 threads, spinning on each other, ran 5-30x slower than 1)")  # fmt: skip
    p.add_argument("--alone", type=int, default=8, help="requests served alone for the SLO")
    p.add_argument("--burst", type=int, default=32, help="requests of the capacity burst")
    p.add_argument(
        "--adapter-dir",
        type=Path,
        default=None,
        help="default /tmp/toppings-queueing-adapters (SmolLM2's), else per model",
    )
    p.add_argument("--out", type=Path, default=None, help="default bench/results/, or /tmp/")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.adapter_dir is None:
        own = "queueing" if args.model == "smollm2" else f"chunked-{Path(args.model).name}"
        args.adapter_dir = Path(f"/tmp/toppings-{own}-adapters")
    if args.out is None:
        name = "chunked_prefill_quick.json" if args.quick else "chunked_prefill.json"
        args.out = Path("/tmp" if args.quick else "bench/results") / name
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    began = time.monotonic()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model_dir = resolve_model_dir(args.model)
    # a weightless checkpoint's adapters are drawn from its shapes alone
    adapters = make_adapters(args.adapter_dir, model_dir, args.per_rank,
                             from_shapes=args.load_format == "dummy")  # fmt: skip
    long_len = LengthSpec.parse(args.long_prompt_len, 1 << 30, "prompt")
    long_min = int(long_len.a)  # every long prompt has at least this many tokens

    def trace(rps: float, seed: int, duration: float | None, num: int | None = None):
        base = trace_for(args, adapters, rps, seed, duration, num)
        return mix_long_prompts(base, args.long_share, long_len, seed)

    startup = StartupLog()
    logging.getLogger(BUDGET_LOGGER).addHandler(startup)
    config = EngineConfig(device=args.device, dtype=args.dtype, load_format=args.load_format,
                          max_total_tokens=args.max_total_tokens,
                          max_batch_size=args.max_batch_size,
                          max_prefill_tokens=args.max_prefill_tokens, chunked_prefill=False,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          queue_policy=args.queue_policy)  # fmt: skip
    if args.itl_target_ms is not None:
        config = dataclasses.replace(config, itl_target_ms=args.itl_target_ms)
    unchunked = build_engine(str(model_dir), config, adapters)
    # From the first engine's config, "auto" dtype resolved: start-up measures the machine and
    # could pick another dtype the second time, and the engines must differ only in chunking.
    chunked_config = dataclasses.replace(unchunked.config, chunked_prefill=True)
    engines = {
        UNCHUNKED: unchunked,
        CHUNKED: build_engine(str(model_dir), chunked_config, adapters),
    }
    for target in args.itl_targets:
        sized = dataclasses.replace(chunked_config, itl_target_ms=target)
        engines[target_mode(target)] = build_engine(
            str(model_dir), sized, adapters, step_model=engines[CHUNKED].step_model
        )
    for floor in args.gemm_floors:  # the start-up model, its floor given (--chunk-floor-tokens)
        floored = dataclasses.replace(chunked_config, chunk_floor_tokens=floor)
        engines[floor_mode(floor)] = build_engine(
            str(model_dir), floored, adapters, step_model=engines[CHUNKED].step_model
        )
    logging.getLogger(BUDGET_LOGGER).removeHandler(startup)
    slo_ms = slo_ms_alone(unchunked, trace(1.0, 999, None, args.alone))
    burst = trace(1.0, 998, None, args.burst)
    capacity = {m: burst_capacity(replay_timed(e, burst, burst=True)) for m, e in engines.items()}
    log.info("SLO %.0f ms; capacity %s", slo_ms, capacity)
    rng = random.Random(997)
    longs = sorted(long_len.sample(rng) for _ in range(1000))
    lengths = sorted({64, 256, args.max_prompt_len, *(longs[min(q * 250, 999)] for q in range(5))})
    alone = alone_ttft_ms({m: engines[m] for m in (UNCHUNKED, CHUNKED)}, lengths, 997)
    log.info("alone TTFT (ms) by prompt length: %s", alone)
    fractions = [float(x) for x in args.loads.split(",")]
    loads = [f * capacity[UNCHUNKED] for f in fractions]
    replays = {m: (lambda tr, e=e: replay_timed(e, tr)) for m, e in engines.items()}
    failed: dict[str, str] = {}
    llama = start_llama(args, unchunked.config.dtype) if args.llama_server else None
    try:
        if llama is not None:
            url = llama[1]
            replays[LLAMA] = lambda tr: replay_llama(url, tr, token_gaps)
            replays[LLAMA](trace(1.0, 996, None, 2))  # a warm-up, not kept
        raw = run_rounds(args, replays, loads, trace, long_min, failed)
    finally:
        if llama is not None:
            stop([llama[0]])
    dtype = unchunked.config.dtype  # "auto" resolved
    step = {m: {"tokens": e.step_budget.tokens, "itl_target_ms": e.step_budget.itl_target_ms,
                "how": e.step_budget.how,
                "gemm_floors": e.step_model.gemm_floors if e.step_model else None}
            for m, e in engines.items() if e.step_budget is not None}  # fmt: skip
    step[CHUNKED]["startup_log"] = startup.lines
    step[UNCHUNKED] = {"max_prefill_tokens": args.max_prefill_tokens}
    for e in engines.values():
        e.shutdown()
    if llama is not None:
        step[LLAMA] = {"version": llama[2], "command": llama[3], "error": failed.get(LLAMA),
                       "threads_probe_s": llama[4]}  # fmt: skip
    per_load = {
        m: [{**summarise(runs, slo_ms / 1000, args.duration), **summarise_itl(runs, long_min)}
            for runs in raw[m]]
        for m in raw
    }  # fmt: skip
    for i, row in enumerate(per_load[UNCHUNKED]):  # the same trace for every engine
        lens = [r["prompt_len"] for run in raw[UNCHUNKED][i] for r in run]
        row["ttft_p99_floor_ms"] = ttft_floor(alone, lens)
    rounds = {  # each round alone: the spread of the ratios
        m: [[{**summarise([run], slo_ms / 1000, args.duration), **summarise_itl([run], long_min)}
             for run in runs] for runs in raw[m]]
        for m in raw if m != LLAMA
    }  # fmt: skip
    spread = {m: [[ratios(c, n) for c, n in zip(cs, ns)]
                  for cs, ns in zip(rounds[m], rounds[UNCHUNKED])]
              for m in rounds if m != UNCHUNKED}  # fmt: skip
    log.info("measured in %.0f s", time.monotonic() - began)
    write(args, argv, dtype, slo_ms, capacity, fractions, loads, per_load, step, alone, spread)


def run_rounds(args, replays: dict, loads: list[float], trace, long_min: int, failed: dict) -> dict:
    """Every arm (`replays`: name -> trace -> records) on the same trace at each load, in an
    order that alternates by round and load; records by arm, load, round. An arm of llama-server
    that fails is dropped (`failed`: its error)."""
    raw: dict[str, list[list[list[dict]]]] = {m: [[] for _ in loads] for m in replays}
    modes = list(replays)
    for rnd in range(args.rounds):
        for i, rps in enumerate(loads):
            run_trace = trace(rps, seed=rnd * 100 + i, duration=args.duration)
            for mode in modes if (rnd + i) % 2 == 0 else modes[::-1]:
                if mode not in raw:
                    continue
                try:
                    raw[mode][i].append(replays[mode](run_trace))
                except Exception as exc:  # llama-server failing ends its arm, not the run
                    if mode != LLAMA:
                        raise
                    log.exception("llama-server's arm failed; the run goes on without it")
                    failed[mode] = f"round {rnd} load {rps:.2f} rps: {exc}"
                    del raw[mode]
                    continue
                row = summarise_itl(raw[mode][i][-1:], long_min)
                log.info("round %d load %.2f rps %s: ITL p99 %.0f ms, %d gaps", rnd, rps,
                         mode, row["itl_p99_ms"], row["num_gaps"])  # fmt: skip
    return raw


def start_llama(args, dtype: str) -> tuple:
    """llama-server for the run: (process, url, version, command, thread probe), healthy. Its
    slots are the engines' batch, its KV one pool (-kvu) of --llama-ctx tokens, its batch sizes
    its own; its thread count the fastest of --threads on one request."""
    suffix = {"bfloat16": "bf16", "float32": "f32"}.get(dtype)
    if suffix is None or f"-{suffix}." not in args.llama_gguf.name:
        raise SystemExit(f"bench_chunked_prefill: {args.llama_gguf} is not the engines' {dtype}")
    candidates = [int(t) for t in str(args.threads).split(",") if t]
    probe: dict[int, float] = {}
    for threads in candidates if len(candidates) > 1 else ():
        proc, url = launch_llama(args, threads)
        try:
            probe[threads] = time_llama(url)
        finally:
            stop([proc])
    threads = min(probe, key=probe.get) if probe else candidates[0]
    log.info("llama-server: %d threads (one request's seconds by threads: %s)", threads, probe)
    proc, url = launch_llama(args, threads)
    command = " ".join(map(str, proc.args))
    return proc, url, llama_version(args.llama_server), command, probe


def launch_llama(args, threads: int) -> tuple:
    port = free_port()
    log_path = Path("/tmp") / f"bench_chunked_prefill_llama_{port}.log"
    slots = args.llama_slots or args.max_batch_size
    proc = start_llama_server(args.llama_server, args.llama_gguf, port, args.llama_ctx,
                              threads, log_path, slots, ("-kvu",))  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, log_path, 300.0)
    return proc, url


def time_llama(url: str) -> float:
    """Seconds of one request (500 random prompt tokens, 16 new) after a warm-up one."""
    rng = random.Random(995)
    for n in (64, 500):
        entry = TraceEntry(0, 0.0, "", 0, [rng.randrange(100, 250) for _ in range(n)], 16)
        began = time.monotonic()
        stream_one(url, entry)
    return time.monotonic() - began


def worst(rows: list[dict]) -> dict:
    """Each ratio of `rows` (one per load) at its worst over them (WORSE_IF_LARGER)."""
    return {k: (max if WORSE_IF_LARGER[k] else min)(r[k] for r in rows) for k in rows[0]}


def ratios(chunked: dict, unchunked: dict) -> dict:
    """A chunked engine's row against the unchunked one's, at one load."""
    return {
        "itl_p99_ratio": chunked["itl_p99_ms"] / unchunked["itl_p99_ms"],
        "itl_max_ratio": chunked["itl_max_ms"] / unchunked["itl_max_ms"],
        "ttft_p99_ratio": chunked["ttft_p99_ms"] / unchunked["ttft_p99_ms"],
        "throughput_ratio": chunked["output_tokens_per_s"] / unchunked["output_tokens_per_s"],
        "itl_p50_ratio": chunked["itl_p50_ms"] / unchunked["itl_p50_ms"],
    }


def as_text(row: dict) -> dict:
    """A row with its P99 TTFT to the first text in place of the one to the first token."""
    return {**row, "ttft_p99_ms": row["ttft_text_p99_ms"]}


def write(
    args, argv, dtype, slo_ms, capacity, fractions, loads, per_load, step, alone, spread
) -> None:
    at, within = slo_knee([r["ttft_p99_ms"] for r in per_load[UNCHUNKED]], slo_ms)
    u = per_load[UNCHUNKED]
    by_load = {m: [ratios(c, n) for c, n in zip(per_load[m], u)]  # each chunked engine's
               for m in per_load if m not in (UNCHUNKED, LLAMA)}  # fmt: skip
    sweep = {
        m: {"tokens": step[m]["tokens"], "itl_target_ms": step[m]["itl_target_ms"],
            "gemm_floors": step[m]["gemm_floors"],
            **worst(by_load[m]),
            "ratios_per_load": by_load[m],
            "ratios_per_round_per_load": spread[m],
            "itl_p99_ms": [r["itl_p99_ms"] for r in per_load[m]],
            "ttft_p99_ms": [r["ttft_p99_ms"] for r in per_load[m]],
            "capacity_ratio": capacity[m] / capacity[UNCHUNKED]}
        for m in by_load
    }  # fmt: skip
    per_ratios = by_load[CHUNKED]
    metrics = {
        **worst(per_ratios),  # the worst over the loads; each load's beside
        "ratios_per_load": per_ratios,
        "ratios_per_round_per_load": spread[CHUNKED],  # each round's own, by load then round
        # no engine's P99 TTFT at a load can be below this share of the unchunked one's
        "ttft_p99_floor_ratio_per_load": [r["ttft_p99_floor_ms"] / r["ttft_p99_ms"] for r in u],
        "alone_ttft_ms": alone,
        "loads_fraction_of_capacity": fractions,
        "loads_rps": loads,
        "slo_knee_load_fraction": fractions[at],
        "slo_knee_within_slo": within,
        "slo_ms": slo_ms,
        "capacity_rps": capacity,
        "capacity_ratio": capacity[CHUNKED] / capacity[UNCHUNKED],
        "step_budget": step,
        "target_sweep": sweep,
        "per_load": per_load,
    }
    if LLAMA in per_load:  # chunked / llama-server, same trace, same rounds, TTFT to text
        vs_llama = [ratios(as_text(c), as_text(q))
                    for c, q in zip(per_load[CHUNKED], per_load[LLAMA])]  # fmt: skip
        metrics.update({f"{k}_vs_llama_server": v for k, v in worst(vs_llama).items()})
        metrics["ratios_vs_llama_server_per_load"] = vs_llama
    write_result(
        args.out,
        "chunked_prefill",
        "bench_chunked_prefill",
        device=describe_device(),
        argv=argv,
        config={
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "model": f"{args.model} ({dtype}, {args.device}, weights {args.load_format}), "
            "in-process engines, lora-mode cached",
            "engines": "EngineConfigs equal but for chunked_prefill (on / off) and, for "
            "--itl-targets, itl_target_ms; --gemm-floors: the chunked config with "
            "chunk_floor_tokens (--chunk-floor-tokens): a GEMM floor of that many tokens "
            "beside any number of decodes",
            "workload": "bench_queueing's trace (ranks 8-128 on q,k,v, zipf within a rank, "
            "lmsys prompt lengths) with --long-share of the requests given long prompts",
            "itl_rule": "gaps between outputs with new tokens, timed in the engine thread; "
            "k tokens in one output: k gaps of gap/k",
            "slo_rule": f"5x mean E2E of {args.alone} requests served alone (unchunked)",
            "capacity_rule": "bench_queueing's burst rule, unchunked engine",
            "knee_rule": "highest load with unchunked P99 TTFT within the SLO (recorded only: "
            "the top-level ratios are the worst over the loads)",
            "llama_server": "the same trace replayed against llama.cpp's llama-server in the "
            "same alternating rounds when --llama-server is given (bench/llama_replay.py: "
            "client-side times over HTTP, the base model: it serves no adapter)",
            "floor_rule": "ttft_p99_floor_ms: the P99 over a load's requests of the alone TTFT "
            "(the least of both engines, base model) of the longest measured prompt length not "
            "above each request's: a request waits at least its own prefill alone",
        },
        metrics=metrics,
    )
    log.info("%s", {k: v for k, v in metrics.items() if k != "per_load"})


if __name__ == "__main__":
    main()
