"""A long prompt beside decoding streams, the real engine stepped by hand: each step's plan as it
ran (the prompt's chunk, its past, which attention kernel took it), its measured and modelled
time and the budget it was planned with, and the prompt's time to first token.

The evidence behind server/sched/tiles.py and step_refit.py's joint fit: with `--chunked on`
(the engine's own budget, measured at start-up and refitted as it runs) against `--chunked off`
(the prompt in one step), on the default model (`smollm2`, converted and cached).

    python -m bench.probe_long_prompt_steps --streams 4 --prompt 2500 --threads 1 \
        --out /tmp/long_prompt_steps.json
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from toppings.server.config import EngineConfig
from toppings.server.engine.engine import Engine
from toppings.server.model.loader import load_checkpoint, resolve_model_dir
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.sched.step_refit import StepShape, modelled_ms
from toppings.server.sched.tiles import key_reads, runs_tiled

log = logging.getLogger("probe_long_prompt_steps")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--streams", type=int, default=4, help="requests decoding beside the prompt")
    p.add_argument("--prompt", type=int, default=2500, help="the long prompt's tokens")
    p.add_argument("--chunked", default="on", choices=("on", "off"))
    p.add_argument("--threads", type=int, default=0, help="the engine's (0: every core)")
    p.add_argument("--warm", type=int, default=24, help="decode steps before the prompt")
    p.add_argument("--out", type=Path, default=Path("/tmp/long_prompt_steps.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = EngineConfig(dtype=args.dtype, max_total_tokens=16384, max_batch_size=32,
                          chunked_prefill=args.chunked == "on", max_prefill_tokens=8192,
                          num_threads=args.threads)  # fmt: skip
    engine = Engine(config, load_checkpoint(str(resolve_model_dir(args.model))))
    try:
        return _run(engine, args)
    finally:
        engine.shutdown()


def _run(engine: Engine, args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_new_tokens=600, temperature=0.0, ignore_eos=True)
    for _ in range(args.streams):
        ids = torch.randint(3, 30000, (64,), generator=gen).tolist()
        engine.submit(GenerationRequest(ids, params))
    decode_ms = []
    for _ in range(args.warm):
        began = time.perf_counter()
        engine.step()
        decode_ms.append(1000 * (time.perf_counter() - began))
    prompt = torch.randint(3, 30000, (args.prompt,), generator=gen).tolist()
    engine.submit(GenerationRequest(prompt, SamplingParams(max_new_tokens=2)))
    steps, began, past, seq = [], time.perf_counter(), 0, None
    while seq is None or not seq.output_ids:
        model, budget = engine.step_model, engine.step_budget
        start = time.perf_counter()
        plan = engine.step()
        ms = 1000 * (time.perf_counter() - start)
        seq = seq or next((s for s in plan.seqs if s.prompt_len == args.prompt), None)
        if seq is None:
            continue
        n = seq.num_prefilled - past
        shape = StepShape(len(plan.seqs) - 1, n, key_reads(n, past))
        row = {
            "tokens": n, "past": past, "decodes": shape.num_decodes, "ms": round(ms, 1),
            "kernel": "tiles" if runs_tiled(n, past) else "rows",
            "modelled_ms": round(modelled_ms(model, shape), 1) if model else None,
            "budget": budget.tokens if budget else None,
            "past_weight": round(budget.past_weight, 6) if budget else None,
        }  # fmt: skip
        steps.append(row)
        log.info("%s", json.dumps(row))
        past = seq.num_prefilled
    rows = [s for s in steps if s["kernel"] == "rows"]
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "decode_ms_median": sorted(decode_ms)[len(decode_ms) // 2],
        "ttft_s": time.perf_counter() - began,
        "steps": len(steps),
        "rows_steps": len(rows),
        "rows_tokens": sum(s["tokens"] for s in rows),
        "largest_step_ms": max(s["ms"] for s in steps),
        "steps_log": steps,
    }
    args.out.write_text(json.dumps(result, indent=1))
    log.info("%s", json.dumps({k: v for k, v in result.items() if k != "steps_log"}))
    return result


if __name__ == "__main__":
    main()
