"""A burst of chat requests whose max_tokens is far above what they write, on a server whose
admission reserves KV for the output expected from its recent requests and on one that
reserves all of max_tokens (`toppings-serve --kv-admission expected|worst-case`,
server/sched/scheduler.py `Scheduler.add`); writes bench/results/kv_admission.json.

What users send: OpenAI clients that set a large `max_tokens` (4,096 here) for answers of a few
dozen tokens. With worst-case reservations a request holds prompt + max_tokens of KV from its
admission, so `--max-total-tokens` (32,768 by default on a CPU) runs about seven of them at once
whatever `--max-batch-size` allows; with expected reservations the same memory holds the batch.

Two servers of the same model run side by side; only one is loaded at a time. In each round,
for each server in an order that flips every round: `--burst` chat requests at once (greedy,
streamed), each a one-sentence question (`QUESTIONS`, cycled), and with `--long-every N`
every Nth one a request for a long story (`STORIES`), which outgrows what the history of
mostly short answers expects: the preemptions' case. Reported per server: the burst's
makespan (first request sent to its last answer), output tokens per second over it, the median
time to first token, the most requests running at once (/metrics, polled), the preemptions
(/stats), each the median round with its spread; and the paired expected / worst-case ratios.
Both servers answer the same questions greedily: the output tokens of a round are reported for
each, so that a difference in work shows.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from bench.bench_single_stream import HelpFormatter, spread, start_server, stop_all, wait_healthy
from bench.common import alternating, free_port, sse_events
from bench.envelope import describe_device, write_result

log = logging.getLogger("bench_kv_admission")
KINDS = ("expected", "worst-case")
TOPICS = ("the sun", "rain", "a violin", "bread", "the moon", "a river", "chess", "coffee",
          "a bicycle", "snow", "a library", "honey", "a volcano", "the ocean", "a clock",
          "tea")  # fmt: skip
QUESTIONS = [f"In one sentence, what is {t}?" for t in TOPICS]
STORIES = [f"Write a long story about {t}." for t in TOPICS]


def timed_chat(url: str, body: dict) -> tuple[float, float, float, int]:
    """Send one streamed chat completion; when it was sent, its first token came and it ended
    (time.perf_counter), and its output tokens (the usage chunk)."""
    sent, first, tokens = time.perf_counter(), None, None
    for chunk in sse_events(url, "/v1/chat/completions", body, timeout_s=1200):
        if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
            first = time.perf_counter()
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    if first is None or tokens is None:
        raise RuntimeError(f"{url}: no token or no usage streamed")
    return sent, first, time.perf_counter(), tokens


def ask(i: int, long_every: int) -> str:
    """The i-th request's question: a one-sentence one, or every `long_every`-th a story."""
    if long_every and i % long_every == long_every - 1:
        return STORIES[i % len(STORIES)]
    return QUESTIONS[i % len(QUESTIONS)]


def one_round(url: str, args: argparse.Namespace) -> dict:
    """The burst; its timings, tokens, the most requests running at once and the preemptions."""
    bodies = [{"model": args.model_name, "max_tokens": args.max_tokens, "temperature": 0.0,
               "messages": [{"role": "user", "content": ask(i, args.long_every)}],
               "stream": True, "stream_options": {"include_usage": True}}
              for i in range(args.burst)]  # fmt: skip
    before = requests.get(url + "/stats", timeout=30).json()["queueing"]["preemptions"]
    results: dict[int, tuple[float, float, float, int] | Exception] = {}
    done = threading.Event()
    most_running = [0]

    def watch() -> None:
        while not done.is_set():
            text = requests.get(url + "/metrics", timeout=30).text
            for line in text.splitlines():
                if line.startswith("toppings:num_requests_running "):
                    most_running[0] = max(most_running[0], int(float(line.split()[1])))
            time.sleep(0.05)

    def send(i: int, body: dict) -> None:
        try:
            results[i] = timed_chat(url, body)
        except Exception as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.perf_counter()
    threads = [threading.Thread(target=send, args=(i, b)) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    errors = [r for r in results.values() if isinstance(r, Exception)]
    if errors:
        raise RuntimeError(f"{url}: {len(errors)} requests failed, first: {errors[0]}")
    rows = [results[i] for i in range(args.burst)]
    makespan = max(end for _, _, end, _ in rows) - start
    tokens = sum(n for *_, n in rows)
    after = requests.get(url + "/stats", timeout=30).json()["queueing"]["preemptions"]
    return {
        "makespan_s": makespan,
        "output_tokens_per_s": tokens / makespan,
        "median_ttft_s": statistics.median(first - sent for sent, first, _, _ in rows),
        "output_tokens": tokens,
        "most_running": most_running[0],
        "preemptions": after - before,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add = parser.add_argument
    add("--model", default="smollm2", help="what toppings-serve --model takes")
    add("--model-name", default="SmolLM2-135M-Instruct", help="the model's name in requests")
    add("--dtype", default="bfloat16", help="toppings-serve --dtype")
    add("--max-batch-size", type=int, default=64, help="toppings-serve --max-batch-size")
    add("--max-total-tokens", type=int, default=32768, help="toppings-serve --max-total-tokens")
    add("--burst", type=int, default=64, help="chat requests sent at once")
    add("--max-tokens", type=int, default=4096, help="max_tokens of every request")
    add("--long-every", type=int, default=0,
        help="every Nth request asks for a long story instead (0: none): the history "
             "expects short answers, these outgrow their reservations")  # fmt: skip
    add("--rounds", type=int, default=3, help="timed rounds after one warm-up round per server")
    add("--threads", type=int, default=2, help="toppings-serve --torch-threads")
    add("--work-dir", type=Path, default=None, help="server logs; none: a temp dir")
    add("--out", type=Path, default=Path("bench/results/kv_admission.json"), help="result file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="kv_admission_"))
    work.mkdir(parents=True, exist_ok=True)
    urls, procs = {}, []
    try:
        for kind in KINDS:
            port = free_port()
            serve = ["--model", args.model, "--dtype", args.dtype, "--port", str(port),
                     "--torch-threads", str(args.threads), "--kv-admission", kind,
                     "--max-batch-size", str(args.max_batch_size),
                     "--max-total-tokens", str(args.max_total_tokens),
                     "--max-concurrent-requests", str(4 * args.burst)]  # fmt: skip
            log_path = work / f"server_{kind}.log"
            procs.append(start_server(sys.executable, serve, log_path))
            urls[kind] = f"http://127.0.0.1:{port}"
            wait_healthy(urls[kind], procs[-1], log_path, 600)
        for kind in KINDS:  # warm-up: the expected server learns its requests' lengths here
            one_round(urls[kind], args)
        rows: dict[str, list[dict]] = {k: [] for k in KINDS}
        for r, kind in alternating(KINDS, args.rounds):
            rows[kind].append(one_round(urls[kind], args))
            shown = {k: round(v, 3) for k, v in rows[kind][-1].items()}
            log.info("round %d %s: %s", r, kind, shown)
    finally:
        stop_all(procs)
    metrics: dict = {kind: {key: spread([row[key] for row in rows[kind]]) for key in rows[kind][0]}
                     for kind in KINDS}  # fmt: skip
    for key in ("makespan_s", "output_tokens_per_s", "median_ttft_s"):
        ratios = [e[key] / w[key] for e, w in zip(rows["expected"], rows["worst-case"])]
        metrics[f"{key}_expected_vs_worst"] = spread(ratios)
        log.info("%s: expected %s, worst-case %s, ratio %s", key,
                 metrics["expected"][key]["median"], metrics["worst-case"][key]["median"],
                 metrics[f"{key}_expected_vs_worst"]["median"])  # fmt: skip
    config = {k: v for k, v in vars(args).items() if k not in ("out", "work_dir")}
    config.update(questions=QUESTIONS, stories=STORIES if args.long_every else [])
    write_result(args.out, "kv_admission", "bench_kv_admission", device=describe_device(),
                 config=config, metrics=metrics, argv=argv)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
