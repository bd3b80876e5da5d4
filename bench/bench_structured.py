"""Structured output under load: the mixed-adapter throughput workload with 0%, 50% and 100% of
its requests constrained by a JSON schema, and the grammar compile time.

Every request runs exactly `--new-tokens` tokens: free ones with `ignore_eos`, constrained ones
under an array schema whose `minItems` the model cannot reach first (each request its own
schema: distinct property names, so distinct grammars), so the shares compare per token.
Shares run in alternating order for `--rounds` rounds on fresh prompts; per share the median
round's output tokens/s and mean time per output token (TPOT: (E2E - TTFT) / (tokens - 1)).
Every run gets fresh prompts (none is in the prefix cache). Headline:
`tpot_ratio_constrained_vs_free`, the median over rounds of TPOT at 100% / TPOT at 0% of the
same round (each round's ratio in `tpot_ratio_per_round`). Compile time: each of
`--num-schemas` schemas compiled by a fresh `GrammarCompiler` (cold), then again (cached), p50
and p99 in ms. llguidance builds a grammar's lexer lazily: part of a cold grammar's cost is paid
in its first masks, inside the TPOT above.

    python -m bench.bench_structured --out bench/results/structured_output.json
    python -m bench.bench_structured --quick   # a smoke run: a few requests, a few tokens
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

from bench.envelope import describe_device, write_result
from toppings.scripts.make_adapters import make_random_adapter
from toppings.server.config import EngineConfig
from toppings.server.model.loader import resolve_model_dir
from toppings.server.requests.request import (
    Constraint,
    ConstraintKind,
    GenerationRequest,
    SamplingParams,
)
from toppings.server.runtime import build_engine
from toppings.server.sampling.grammar import GrammarCompiler

log = logging.getLogger("bench_structured")
RANKS = (8, 16, 32, 64)
SHARES = (0.0, 0.5, 1.0)


def record_schema(idx: int, min_items: int) -> dict:
    """An array of records no shorter than `min_items`: property names differ per `idx`."""
    record = {
        "type": "object",
        "properties": {
            f"id_{idx}": {"type": "integer", "minimum": 0, "maximum": 9999},
            f"label_{idx}": {"enum": ["red", "green", "blue"]},
            f"note_{idx}": {"type": "string", "maxLength": 16},
            f"ok_{idx}": {"type": "boolean"},
        },
        "required": [f"id_{idx}", f"label_{idx}", f"ok_{idx}"],
        "additionalProperties": False,
    }
    return {"type": "array", "items": record, "minItems": min_items}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_share(engine, prompts, names, share: float, new_tokens: int, round_idx: int) -> dict:
    """One batch with `share` of its requests constrained (every other one at 50%)."""
    num_constrained = round(share * len(prompts))
    step = len(prompts) / num_constrained if num_constrained else 0
    constrained = {int(i * step) for i in range(num_constrained)}
    reqs = []
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        constraint = None
        if i in constrained:
            schema = record_schema(1000 * round_idx + i, min_items=new_tokens)
            constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                                constraint=constraint)  # fmt: skip
        reqs.append(GenerationRequest(prompt, params, engine.resolve_adapter(name)))
    start = time.perf_counter()
    outs = [h.result() for h in engine.submit_all(reqs)]
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.new_token_ids) for o in outs)
    tpots = [(o.e2e_s - o.ttft_s) / (len(o.new_token_ids) - 1) for o in outs
             if len(o.new_token_ids) > 1]  # fmt: skip
    return {
        "share": share,
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "tpot_ms": 1000 * statistics.mean(tpots),
        "all_full_length": all(len(o.new_token_ids) == new_tokens for o in outs),
    }


def compile_times(engine, num_schemas: int) -> dict:
    """Cold and cached compile times (ms) of `num_schemas` schemas on a fresh compiler."""
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.eos_ids)
    compiler.compile(Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "object"}'))  # tokenizer
    constraints = [
        Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(record_schema(10_000 + i, 1 + i % 8)))
        for i in range(num_schemas)
    ]
    times = {}
    for label in ("cold", "cached"):
        ms = []
        for c in constraints:
            started = time.perf_counter()
            compiler.compile(c)
            ms.append(1000 * (time.perf_counter() - started))
        times[label] = {"p50_ms": percentile(ms, 0.5), "p99_ms": percentile(ms, 0.99)}
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--num-adapters", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-schemas", type=int, default=50)
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0: every core")
    p.add_argument("--adapter-dir", default="/tmp/toppings-bench-adapters")
    p.add_argument("--quick", action="store_true", help="a smoke run: 8 requests, 12 tokens")
    p.add_argument("--out", default="bench/results/structured_output.json")
    args = p.parse_args(argv)
    if args.quick:
        args.num_adapters, args.num_requests, args.prompt_len = 4, 8, 32
        args.new_tokens, args.rounds, args.num_schemas = 12, 1, 10
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model_dir = resolve_model_dir(args.model)
    adapters = {}
    for i in range(args.num_adapters):
        rank = RANKS[i % len(RANKS)]
        path = Path(args.adapter_dir) / f"bench-r{rank}-{i}"
        if not (path / "adapter_config.json").is_file():
            make_random_adapter(path, model_dir, rank=rank, target_modules=("q_proj", "k_proj",
                                "v_proj"), seed=i)  # fmt: skip
        adapters[f"a{i}"] = str(path)
    config = EngineConfig(
        dtype=args.dtype,
        max_batch_size=args.num_requests,
        max_total_tokens=args.num_requests * (args.prompt_len + args.new_tokens),
        num_threads=threads,
    )
    engine = build_engine(str(model_dir), config, adapters)
    names = [f"a{i % args.num_adapters}" for i in range(args.num_requests)]
    vocab = engine.model_config.vocab_size
    try:
        compile_ms = compile_times(engine, args.num_schemas)
        gen = torch.Generator().manual_seed(0)
        warm = [torch.randint(100, vocab, (args.prompt_len,), generator=gen).tolist()
                for _ in range(min(8, args.num_requests))]  # fmt: skip
        run_share(engine, warm, names, 0.5, 4, round_idx=99)
        runs: dict[float, list[dict]] = {s: [] for s in SHARES}
        for round_idx in range(args.rounds):
            for share in SHARES if round_idx % 2 == 0 else SHARES[::-1]:
                # Fresh prompts for every run: a share run after another on the same prompts
                # would find them in the prefix cache and skip the prefill the first one paid.
                prompts = [torch.randint(100, vocab, (args.prompt_len,), generator=gen).tolist()
                           for _ in range(args.num_requests)]  # fmt: skip
                runs[share].append(run_share(engine, prompts, names, share, args.new_tokens,
                                             round_idx))  # fmt: skip
                log.info("round %d: %s", round_idx, runs[share][-1])
    finally:
        engine.shutdown()
    median = {s: sorted(r, key=lambda x: x["tokens_per_s"])[len(r) // 2] for s, r in runs.items()}
    paired = sorted(c["tpot_ms"] / f["tpot_ms"] for c, f in zip(runs[1.0], runs[0.0]))
    metrics = {
        # the median over rounds of each round's TPOT at 100% over its TPOT at 0%
        "tpot_ratio_constrained_vs_free": statistics.median(paired),
        "tpot_ratio_per_round": paired,
        "shares": {f"{int(100 * s)}%": median[s] for s in SHARES},
        "rounds": {f"{int(100 * s)}%": runs[s] for s in SHARES},
        "compile": compile_ms,
        "quick_smoke_run": args.quick,
    }
    config_out = {k: v for k, v in vars(args).items() if k not in ("out",)}
    result = write_result(args.out, "structured_output", "bench_structured",
                          device=describe_device(), argv=argv, config=config_out,
                          metrics=metrics)  # fmt: skip
    print(json.dumps(result["metrics"], indent=1))


if __name__ == "__main__":
    main()
