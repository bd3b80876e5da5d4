"""What one long prompt does to the streams decoding beside it: step times on SmolLM2.

`--streams` requests decode (short prompts, long outputs); once they all decode, one prompt of
`--prompt-len` tokens arrives. Three engines, equal but for how prompts are stepped:
- `unchunked`: the prompt is prefilled whole in one step (`--chunked-prefill off`);
- `chunked`: the engine's own budget, sized at start-up for its inter-token target, with late
  chunks weighted by their past (server.sched.step_budget, GateLimits.chunk_cost);
- `chunked-unweighted`: the same number of tokens a step given as `--max-num-batched-tokens`,
  so every chunk has that many tokens whatever its past.
Each engine is driven step by step in this process (`Engine.step`, no engine thread), and every
step is timed. Every running stream gets one token a step, so a step's time is the gap between
two of its tokens. Per engine: the decode step before the prompt (median), the steps that carry
the prompt (count, median, max, and max over the engine's inter-token target), and the prompt's
time to first token. `--rounds` repeats the three in alternating order; the maxima are taken
over rounds, the medians pooled. Two first, unmeasured passes (`--warmup-steps` decode steps, then
the prompt) let the chunked engine correct its step model from its real steps
(server.sched.step_refit) before the rounds; `chunked-unweighted` then gets the corrected
budget too. The target is reported both as the engine models it and as the default target
(`ITL_MULTIPLE` times the decode step) of the decode step measured here.

    python -m bench.bench_mixed_steps [--streams 32 --prompt-len 4000 --rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import time
from pathlib import Path

import torch

from bench.envelope import describe_device, write_result
from toppings.server.config import DTYPE_CHOICES, EngineConfig
from toppings.server.engine.engine import Engine
from toppings.server.model.loader import load_checkpoint, resolve_model_dir
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.sched.step_budget import ITL_MULTIPLE
from toppings.server.sched.step_refit import WINDOW

log = logging.getLogger("bench_mixed_steps")
UNCHUNKED, CHUNKED, UNWEIGHTED = "unchunked", "chunked", "chunked-unweighted"


def run_once(
    engine: Engine, streams: int, prompt_len: int, seed: int, decode_steps: int = 8
) -> dict:
    """One pass: `streams` requests decode `decode_steps` steps, then the long prompt arrives;
    step times in ms of the decode steps before it and of the steps that computed it, and its
    TTFT in ms."""
    gen = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(100, 40000, (n,), generator=gen).tolist()  # noqa: E731
    decode_params = SamplingParams(max_new_tokens=1000, temperature=0.0, ignore_eos=True)
    handles = [engine.submit(GenerationRequest(ids(40), decode_params)) for _ in range(streams)]
    decode_ms: list[float] = []
    while len(decode_ms) < decode_steps:  # the streams' prompts first, then decode steps
        start = time.perf_counter()
        plan = engine.step()
        if plan is not None and not plan.is_prefill and len(plan.seqs) == streams:
            decode_ms.append(1000 * (time.perf_counter() - start))
    arrived = time.perf_counter()
    long = engine.submit(GenerationRequest(ids(prompt_len), SamplingParams(max_new_tokens=1)))
    prompt_ms: list[float] = []
    while not any(out.new_token_ids for out in long.poll()):
        start = time.perf_counter()
        plan = engine.step()
        if plan is not None and any(s.request is long.request for s in plan.seqs):
            prompt_ms.append(1000 * (time.perf_counter() - start))
    ttft_ms = 1000 * (time.perf_counter() - arrived)
    for h in handles:
        h.abort()
    while engine.scheduler.has_work():
        engine.step()
    return {"decode_ms": decode_ms, "prompt_step_ms": prompt_ms, "ttft_ms": ttft_ms}


def summarise(runs: list[dict], itl_target_ms: float | None) -> dict:
    steps = [ms for r in runs for ms in r["prompt_step_ms"]]
    worst = max(max(r["prompt_step_ms"]) for r in runs)
    return {
        "decode_step_ms_median": statistics.median(ms for r in runs for ms in r["decode_ms"]),
        "prompt_steps": len(runs[0]["prompt_step_ms"]),
        "prompt_step_ms_median": statistics.median(steps),
        "prompt_step_ms_max": worst,
        "prompt_step_ms_max_per_round": [max(r["prompt_step_ms"]) for r in runs],
        "max_over_itl_target": worst / itl_target_ms if itl_target_ms else None,
        "ttft_ms_median": statistics.median(r["ttft_ms"] for r in runs),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=2 * WINDOW,
                   help="decode steps of the unmeasured first pass (0: no first pass)")  # fmt: skip
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_CHOICES)
    p.add_argument("--out", type=Path, default=Path("bench/results/mixed_steps.json"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    checkpoint = load_checkpoint(str(resolve_model_dir("smollm2")))
    base = EngineConfig(dtype=args.dtype, max_batch_size=args.streams + 1,
                        max_total_tokens=args.streams * 1100 + args.prompt_len + 1024)  # fmt: skip
    chunked = Engine(base, checkpoint)
    start_budget = chunked.step_budget
    engines = {
        UNCHUNKED: Engine(dataclasses.replace(base, chunked_prefill=False), checkpoint),
        CHUNKED: chunked,
        UNWEIGHTED: Engine(
            dataclasses.replace(base, max_num_batched_tokens=start_budget.tokens), checkpoint
        ),  # fmt: skip
    }
    if args.warmup_steps:
        for engine in engines.values():  # two passes: a window of mixed steps or more
            for seed in (998, 999):
                run_once(engine, args.streams, args.prompt_len, seed, args.warmup_steps)
        log.info("after the first passes: %d tokens a step (%d at start-up)",
                 chunked.step_budget.tokens, start_budget.tokens)  # fmt: skip
        engines[UNWEIGHTED].scheduler.set_step_budget(
            dataclasses.replace(chunked.step_budget, past_weight=0.0)
        )
    budget = chunked.step_budget
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    names = list(engines)
    for rnd in range(args.rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            runs[name].append(run_once(engines[name], args.streams, args.prompt_len, rnd))
            log.info("round %d %s: %s", rnd, name, summarise(runs[name][-1:], None))
    for e in engines.values():
        e.shutdown()
    rows = {name: summarise(r, budget.itl_target_ms) for name, r in runs.items()}
    measured_target = ITL_MULTIPLE * rows[CHUNKED]["decode_step_ms_median"]
    metrics = {
        "itl_target_ms": budget.itl_target_ms,
        "budget_tokens": budget.tokens,
        "budget_how": budget.how,
        "budget_tokens_at_start_up": start_budget.tokens,
        "itl_target_ms_at_start_up": start_budget.itl_target_ms,
        "step_model": dataclasses.asdict(chunked.step_model),
        "max_step_over_target": rows[CHUNKED]["max_over_itl_target"],
        "max_step_over_measured_default_target": rows[CHUNKED]["prompt_step_ms_max"]
        / measured_target,
        "median_step_over_measured_default_target": rows[CHUNKED]["prompt_step_ms_median"]
        / measured_target,
        "max_step_over_target_unweighted": rows[UNWEIGHTED]["max_over_itl_target"],
        "max_step_ratio_vs_unchunked": rows[CHUNKED]["prompt_step_ms_max"]
        / rows[UNCHUNKED]["prompt_step_ms_max"],
        "ttft_ratio_vs_unchunked": rows[CHUNKED]["ttft_ms_median"]
        / rows[UNCHUNKED]["ttft_ms_median"],
        "per_engine": rows,
    }
    write_result(args.out, "mixed_steps", "bench_mixed_steps", device=describe_device(),
                 argv=argv, config={**{k: str(v) for k, v in vars(args).items()},
                                    "model": f"SmolLM2-135M-Instruct ({args.dtype})"},
                 metrics=metrics)  # fmt: skip
    log.info("%s", {k: v for k, v in metrics.items() if k != "per_engine"})


if __name__ == "__main__":
    main()
