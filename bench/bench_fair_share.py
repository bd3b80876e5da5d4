"""One tenant's flood beside another tenant's single request, with fair shares between adapters
on and off (`toppings-serve --fair-share`, server/sched/fair_share.py); writes
bench/results/fair_share.json.

Two servers of the same model and adapters run side by side (one with `--fair-share on`, one with
`off`); only one of them is loaded at a time. In each round, for each server in an order that flips
every round: tenant A (adapter `caps`) sends `--flood` streamed requests at once, and
`--lone-delay-s` later tenant B (adapter `french`) sends one; every request has a fresh random
`--prompt-len`-token prompt and `--max-tokens` new tokens (ignore_eos). The batch holds
`--max-batch-size` requests, so most of the flood waits. Reported per server: the time to the first
token (TTFT) of B's request, how many of A's requests had their first token before it, A's median
TTFT, the flood's makespan (first request sent to its last answer) and that of all (B's answer
too: the same work either way, in another order), each the median round with its spread, and the
paired on / off ratios (per round, then the median).
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from bench.bench_single_stream import HelpFormatter, spread, start_server, stop_all, wait_healthy
from bench.common import alternating, free_port
from bench.envelope import describe_device, write_result

log = logging.getLogger("bench_fair_share")
ADAPTERS = Path(__file__).resolve().parents[1] / "scripts" / "demo_adapters"
FLOOD, LONE = "caps", "french"


def timed(url: str, body: dict) -> tuple[float, float, float]:
    """Send one streamed completion; when it was sent, its first token came and it ended
    (time.perf_counter)."""
    sent, first = time.perf_counter(), None
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            if first is None and b'"text"' in line:
                first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{url}: no token streamed")
    return sent, first, time.perf_counter()


def one_round(url: str, args: argparse.Namespace, rng: random.Random, vocab: int) -> dict:
    """A's flood, then B's request `--lone-delay-s` later; their timings."""

    def body(model: str) -> dict:
        prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
        return {"model": model, "prompt": prompt, "max_tokens": args.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True}  # fmt: skip

    bodies = [body(FLOOD) for _ in range(args.flood)]
    lone_body = body(LONE)
    results: dict[int, tuple[float, float, float] | Exception] = {}
    start = time.perf_counter()

    def send(i: int, b: dict) -> None:
        try:
            results[i] = timed(url, b)
        except Exception as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    threads = [threading.Thread(target=send, args=(i, b)) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    time.sleep(args.lone_delay_s)
    lone = threading.Thread(target=send, args=(-1, lone_body))
    lone.start()
    for t in [*threads, lone]:
        t.join()
    errors = [r for r in results.values() if isinstance(r, Exception)]
    if errors:
        raise RuntimeError(f"{url}: {len(errors)} requests failed, first: {errors[0]}")
    flood = [results[i] for i in range(args.flood)]
    sent, first, _ = results[-1]
    return {
        "lone_ttft_s": first - sent,
        "flood_median_ttft_s": statistics.median(first - sent for sent, first, _ in flood),
        "flood_makespan_s": max(end for _, _, end in flood) - start,
        # every request, the lone one too: the same work either way, done in another order
        "all_makespan_s": max(end for _, _, end in [*flood, results[-1]]) - start,
        # requests of the flood served first: the order, whatever the machine's speed
        "flood_ahead_of_lone": sum(f < first for _, f, _ in flood),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add = parser.add_argument
    add("--model", default="smollm2", help="what toppings-serve --model takes")
    add("--dtype", default="bfloat16", help="toppings-serve --dtype")
    add("--max-batch-size", type=int, default=8, help="toppings-serve --max-batch-size")
    add("--flood", type=int, default=48, help="tenant A's requests, sent at once")
    add("--lone-delay-s", type=float, default=0.5, help="B's request, this long after A's flood")
    add("--prompt-len", type=int, default=64, help="prompt tokens of every request")
    add("--max-tokens", type=int, default=32, help="new tokens of every request (ignore_eos)")
    add("--rounds", type=int, default=3, help="timed rounds after one warm-up round per server")
    add("--threads", type=int, default=2, help="toppings-serve --torch-threads")
    add("--seed", type=int, default=0, help="seeds the prompts")
    add("--work-dir", type=Path, default=None, help="server logs; none: a temp dir")
    add("--out", type=Path, default=Path("bench/results/fair_share.json"), help="result file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from bench.bench_long_prompt import model_config

    vocab = model_config(args.model).vocab_size
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="fair_share_"))
    work.mkdir(parents=True, exist_ok=True)
    kinds = ("on", "off")
    urls, procs = {}, []
    try:
        for kind in kinds:
            port = free_port()
            serve = ["--model", args.model, "--dtype", args.dtype, "--port", str(port),
                     "--torch-threads", str(args.threads), "--fair-share", kind,
                     "--max-batch-size", str(args.max_batch_size),
                     "--max-concurrent-requests", str(4 * (args.flood + 1)),
                     "--lora", f"{FLOOD}={ADAPTERS / FLOOD}",
                     "--lora", f"{LONE}={ADAPTERS / LONE}"]  # fmt: skip
            log_path = work / f"server_{kind}.log"
            procs.append(start_server(sys.executable, serve, log_path))
            urls[kind] = f"http://127.0.0.1:{port}"
            wait_healthy(urls[kind], procs[-1], log_path, 600)
        rng = random.Random(args.seed)
        for kind in kinds:
            one_round(urls[kind], args, rng, vocab)  # warm-up
        rows: dict[str, list[dict]] = {k: [] for k in kinds}
        for r, kind in alternating(kinds, args.rounds):
            rows[kind].append(one_round(urls[kind], args, rng, vocab))
            shown = {k: round(v, 3) for k, v in rows[kind][-1].items()}
            log.info("round %d %s: %s", r, kind, shown)
    finally:
        stop_all(procs)
    metrics: dict = {kind: {key: spread([row[key] for row in rows[kind]]) for key in rows[kind][0]}
                     for kind in kinds}  # fmt: skip
    timings = [key for key in rows["on"][0] if key.endswith("_s")]
    for key in timings:
        ratios = [on[key] / off[key] for on, off in zip(rows["on"], rows["off"])]
        metrics[f"{key}_on_vs_off"] = spread(ratios)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "work_dir")}
    config.update(tenants={"flood": FLOOD, "lone": LONE}, adapters=str(ADAPTERS))
    write_result(args.out, "fair_share", "bench_fair_share", device=describe_device(),
                 config=config, metrics=metrics, argv=argv)  # fmt: skip
    for key in timings:
        log.info("%s: on %s, off %s, on/off %s", key, metrics["on"][key]["median"],
                 metrics["off"][key]["median"], metrics[f"{key}_on_vs_off"]["median"])  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
