"""One memory for KV and adapters against today's static split, on a multi-turn chat (issue 13).

A chat trace (bench/chat_trace.py: 48 adapters of ranks 8-64 on q, k, v with Zipf popularity,
each with its own 200-400-token system prompt; conversations of 3-6 turns started by Poisson
arrivals, exponential think time between a turn's answer and the next turn; LMSYS-shaped
user-turn and output lengths scaled down for a 2-core CPU: means 35 and 27 tokens instead of
69.5 and 214.5, clipped at 96 and 64) is replayed against three in-process SmolLM2 engines
(float32, lora mode cpu-assisted) with the same total memory budget (bench/memory_setup.py):
`static` (KV / adapters split 80 / 20), `pool` (one pool, no prefix reuse) and `pool_prefix`
(one pool, KV prefix reuse per adapter, host tier over the emulated link). Greedy decoding with
ignore_eos: every turn makes exactly the tokens the trace says, and turn k's prompt holds the
model's actual answers to the turns before it.

Load: first each engine serves a burst of --burst conversations started at once with no think
time (also its warm-up); the capacity of the first config (static) is the conversations per
second it completes while the burst still saturates it (75% of them over the time the 75th
percent took). Conversations then start at --load x that rate, so that static runs at about
--load of what it sustains. Each round makes a new trace (seed =
round) and runs the three configs on it one after the other, in alternating order.

Per config, pooled over rounds: TTFT p50 / p99 (all turns, turns >= 2), time per output token
(mean of (E2E - TTFT) / (out - 1)), output tokens/s, adapter hit rate (engine counters) and
prefix-hit rate (prefix-reused prompt tokens / prompt tokens, the memory counters; null when the
engine has none); the ratios per round give the spread. Headlines (pool_prefix vs static):
ttft_p50_ratio_vs_static, ttft_p99_ratio_vs_static, tpt_ratio_vs_static, prefix_hit_rate; the
`pool` ratios carry a `pool_` prefix.

    python -m bench.bench_memory [--duration 60 --rounds 2 --load 0.65 --budget-mb 128]

The default run takes about 10 minutes on 2 quiet cores (a conversation costs the static engine
about 1,900 prefill and 100 decode tokens), with some 9 conversations (40 turns) per config and
round: the p99s are close to the maxima. `--rounds 3 --duration 120` gives steadier tails.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import threading
import time
from pathlib import Path

from transformers import AutoConfig

from bench.chat_trace import ChatSpec, build_conversations, system_prompts, turn_prompt
from bench.common import link_gbps_for, prefill_ms
from bench.envelope import describe_device, write_result
from bench.memory_plot import plot_ttft_cdf
from bench.memory_setup import (
    CONFIGS,
    DTYPE,
    STATIC_ADAPTER_SHARE,
    Sizes,
    configs_for,
    make_adapters,
)
from bench.memory_stats import (
    burst_capacity,
    config_summary,
    counter_delta,
    headline,
    hit_rates,
    peak_open_tokens,
    summarise,
)
from toppings.scripts.loadgen.workload import LengthSpec
from toppings.server.model.config import ModelConfig
from toppings.server.model.loader import resolve_model_dir
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.runtime import build_engine

log = logging.getLogger("bench_memory")
MB = 1 << 20


def converse(engine, conv, systems, records: list, errors: list, t0: float) -> None:
    """Play one conversation: each turn is sent a think time after the previous one ended."""
    try:
        time.sleep(max(0.0, t0 + conv.start_s - time.monotonic()))
        answers: list[list[int]] = []
        for k in range(conv.num_turns):
            if k:
                time.sleep(conv.think_s[k - 1])
            prompt = turn_prompt(systems[conv.adapter], conv, answers, k)
            params = SamplingParams(
                max_new_tokens=conv.output_lens[k], temperature=0.0, ignore_eos=True
            )
            sent = time.monotonic() - t0
            out = engine.submit(
                GenerationRequest(prompt, params, engine.resolve_adapter(conv.adapter))
            ).result(3600)
            if out.finish_reason not in ("length", "stop"):
                raise RuntimeError(f"turn ended with {out.finish_reason}: {out.error}")
            answers.append(list(out.new_token_ids))
            records.append({
                "conv": conv.idx, "turn": k, "adapter": conv.adapter,
                "prompt_tokens": len(prompt), "output_tokens": out.output_tokens,
                "ttft_s": out.ttft_s, "e2e_s": out.e2e_s, "sent_s": sent,
                "end_s": time.monotonic() - t0,
            })  # fmt: skip
    except Exception as e:  # the main thread re-raises it
        errors.append(e)


def replay(engine, conversations, systems) -> tuple[list[dict], dict]:
    """Run every conversation (one thread each); the turn records and the counters' delta."""
    before = dataclasses.asdict(engine.counters())
    records: list[dict] = []
    errors: list[Exception] = []
    t0 = time.monotonic()
    threads = [threading.Thread(target=converse, args=(engine, c, systems, records, errors, t0))
               for c in conversations]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sorted(records, key=lambda r: (r["sent_s"], r["conv"])), counter_delta(
        before, dataclasses.asdict(engine.counters())
    )


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="smollm2 or a checkpoint directory")
    p.add_argument("--configs", default=",".join(CONFIGS), help="a subset of " + ",".join(CONFIGS))
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--load", type=float, default=0.65, help="fraction of static's capacity")
    p.add_argument("--burst", type=int, default=6, help="conversations of the capacity burst")
    p.add_argument("--budget-mb", type=float, default=128.0, help="device memory, every config")
    p.add_argument("--host-mb", type=float, default=512.0, help="host tier of pool_prefix")
    p.add_argument("--link-gbps", type=float, default=0.0,
                   help="emulated link, Gbit/s; 0: one largest-rank adapter load = one "
                        "128-token prefill, measured at the start")  # fmt: skip
    p.add_argument("--adapters", type=int, default=48)
    p.add_argument("--ranks", default="8,16,32,64")
    p.add_argument("--think-s", type=float, default=3.0, help="mean think time between turns")
    p.add_argument("--user-len", default="lognormal:35:1.0")
    p.add_argument("--max-user-len", type=int, default=96)
    p.add_argument("--output-len", default="lognormal:27:1.0")
    p.add_argument("--max-output-len", type=int, default=64)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--adapter-dir", type=Path, default=Path("/tmp/toppings-memory-adapters"))
    p.add_argument("--out", type=Path, default=Path("bench/results/memory.json"))
    p.add_argument("--plot", type=Path, default=Path("bench/memory_ttft.png"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    names = [n for n in args.configs.split(",") if n]
    model_dir = resolve_model_dir(args.model)
    mc = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir), model_dir.name)
    ranks = [int(r) for r in args.ranks.split(",")]
    adapters = make_adapters(args.adapter_dir / model_dir.name, model_dir, ranks, args.adapters)
    spec = ChatSpec(rate=1.0, think_s=args.think_s,
                    user_len=LengthSpec.parse(args.user_len, args.max_user_len, "prompt"),
                    output_len=LengthSpec.parse(args.output_len, args.max_output_len))  # fmt: skip
    sizes = Sizes.of(mc, adapters, int(args.budget_mb * MB), int(args.host_mb * MB))
    if spec.max_context() > mc.max_position_embeddings:
        raise SystemExit(f"a turn may need {spec.max_context()} tokens: past the model's context")
    sizes.check(spec.max_context())
    link = args.link_gbps
    if not link:
        probe = [100 + i % 150 for i in range(128)]
        link = link_gbps_for(max(sizes.adapter_bytes_by_rank.values()),
                             prefill_ms(str(model_dir), DTYPE, probe) / 1000)  # fmt: skip
    configs = configs_for(names, sizes, link, args.max_batch_size)
    systems = system_prompts(sorted(adapters), spec)
    engines = {n: build_engine(str(model_dir), c, adapters) for n, (c, _) in configs.items()}
    burst = build_conversations(
        dataclasses.replace(spec, rate=1e6, num_conversations=args.burst, think_s=0.0, seed=999),
        sorted(adapters),
    )  # fmt: skip
    capacity = {}
    for name in names:  # also the warm-up of each engine
        capacity[name] = burst_capacity(replay(engines[name], burst, systems)[0])
    rate = args.load * capacity[names[0]]
    log.info("capacity (conversations/s) %s; load %.3f/s; link %.3f Gbit/s", capacity, rate, link)
    raw: dict[str, list] = {n: [] for n in names}
    for rnd in range(args.rounds):
        trace = dataclasses.replace(spec, rate=rate, duration_s=args.duration, seed=rnd)
        conversations = build_conversations(trace, sorted(adapters))
        if len(conversations) < 5:
            log.warning("round %d has %d conversations: raise --duration", rnd, len(conversations))
        for name in names if rnd % 2 == 0 else names[::-1]:
            raw[name].append(replay(engines[name], conversations, systems))
            log.info("round %d %s: %s %s", rnd, name, summarise([raw[name][-1][0]]),
                     hit_rates([raw[name][-1][1]]))  # fmt: skip
    for engine in engines.values():
        engine.shutdown()
    write(args, argv, names, configs, sizes, spec, link, capacity, rate, raw)


def write(args, argv, names, configs, sizes, spec, link, capacity, rate, raw) -> None:
    per_config = {n: config_summary(raw[n]) for n in names}
    metrics = {
        **headline(per_config),
        "capacity_conversations_per_s": capacity,
        "load_conversations_per_s": rate,
        "peak_open_conversation_kv_tokens_per_round": [
            peak_open_tokens(r) for r, _ in raw[names[0]]
        ],
        "per_config": per_config,
    }
    trace = dataclasses.replace(spec, rate=rate, duration_s=args.duration)
    config = {
        **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": f"{args.model} ({DTYPE}), in-process engines, lora mode cpu-assisted",
        "sizes": {**dataclasses.asdict(sizes), "static_adapter_share": STATIC_ADAPTER_SHARE},
        "link_gbps": link,
        "link": f"emulated, {link:.3f} Gbit/s (one largest-rank adapter load = one 128-token "
        "prefill unless --link-gbps); adapter loads in every config, KV swaps in pool_prefix",
        "trace": {
            **dataclasses.asdict(trace),
            "max_context_tokens": spec.max_context(),
            "scaled": "LMSYS means 69.5 / 214.5 (user turn / output) scaled down for a 2-core CPU",
        },
        "capacity_rule": f"burst of {args.burst} conversations, no think time: 75% of them / "
        f"the time the 75th percent took; load = {args.load} x {names[0]}'s",
        "engines": {
            n: {**dataclasses.asdict(c), "fields_dropped": d} for n, (c, d) in configs.items()
        },
    }
    device = f"{describe_device()}, emulated link"
    write_result(args.out, "memory", "bench_memory", device=device, argv=argv, config=config,
                 metrics=metrics)  # fmt: skip
    title = (f"{Path(args.model).name} CPU, {sizes.budget_bytes / MB:.0f} MB for KV + adapters, "
             f"{args.rounds} rounds x {args.duration:.0f} s, emulated link")  # fmt: skip
    plot_ttft_cdf(args.plot, {n: [r for r, _ in raw[n]] for n in names}, title)
    log.info("%s", {k: v for k, v in metrics.items() if k != "per_config"})


if __name__ == "__main__":
    main()
