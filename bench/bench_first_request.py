"""The first request after start-up against a warm one (issue 63: within 1.2x).

Each round starts `toppings-serve` afresh (`--model`, `--device`, `--dtype`, one random adapter
of rank `--rank` on all seven projections registered with `--lora`, `--serve-args` beside) and,
as soon as /health answers, sends one streamed completion on the base model, then the same on
the adapter: the first request of each after start-up. Then each again `--warm` times, in turn,
and last one request of each one token longer: a prompt length the server has not met (`new`).
A request: a `--prompt-len`-token prompt (the same ids every time, so a prefix cache would
hide the prefill: the server runs with `--prefix-cache off` unless `--serve-args` says
otherwise), `--max-tokens` greedy tokens, `ignore_eos`. Per round and kind (`base`, `adapter`):
the time to the first token and to the last of the first request, the warm ones' median and
the new length's; the ratios first / warm and new / warm per round (on a CPU a new prompt
length costs its own oneDNN primitives: server.process.allocator); over the rounds the median
and spread of each, and the start-up time (process start to /health). Writes
bench/results/first_request.json.

    python -m bench.bench_first_request [--rounds 3] [--warm 5] [--device cuda --model DIR
        --serve-args "--load-format dummy"] [--quick]
"""

from __future__ import annotations

import argparse
import logging
import shlex
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import free_port, sse_events, write_random_adapter
from bench.envelope import describe_device, write_result
from toppings.gpu_lora.targets import LORA_TARGETS
from toppings.scripts.children import start, stop, wait_healthy
from toppings.scripts.loadgen.cli import list_models
from toppings.server.model.loader import resolve_model_dir

log = logging.getLogger("bench_first_request")

TARGETS = LORA_TARGETS  # every projection
KINDS = ("base", "adapter")
ADAPTER = "first-request-lora"
QUICK = {"rounds": 1, "warm": 2, "prompt_len": 16, "max_tokens": 4}


def timed_request(url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: ms to its first token and to its end."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    sent = time.perf_counter()
    first = None
    for event in sse_events(url, "/v1/completions", body):
        if (event.get("choices") or [{}])[0].get("text") is not None:
            first = first or time.perf_counter()
    done = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{url}: the stream held no token")
    return {"ttft_ms": 1000 * (first - sent), "total_ms": 1000 * (done - sent)}


def one_round(args, adapter: Path, log_path: Path) -> dict:
    """Start a server, time its first requests and the warm ones, stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ["--model", args.model, "--device", args.device, "--dtype", args.dtype,
            "--lora", f"{ADAPTER}={adapter}", "--port", str(port),
            *shlex.split(args.serve_args)]  # fmt: skip
    if "--prefix-cache" not in argv:
        argv += ["--prefix-cache", "off"]
    started = time.perf_counter()
    proc = start("toppings.server.cli", argv, log_path)
    try:
        wait_healthy(url, proc, log_path, args.start_timeout)
        startup_s = time.perf_counter() - started
        base_name, _ = list_models(url)
        prompt = [100 + i % 1000 for i in range(args.prompt_len)]
        models = {"base": base_name, "adapter": ADAPTER}
        runs = {kind: [timed_request(url, models[kind], prompt, args.max_tokens)]
                for kind in KINDS}  # fmt: skip
        for _ in range(args.warm):
            for kind in KINDS:
                runs[kind].append(timed_request(url, models[kind], prompt, args.max_tokens))
        longer = [*prompt, 100 + args.prompt_len % 1000]
        new = {kind: timed_request(url, models[kind], longer, args.max_tokens) for kind in KINDS}
    finally:
        stop([proc])
    result = {"startup_s": round(startup_s, 2)}
    for kind, times in runs.items():
        first, warm = times[0], times[1:]
        row = {}
        for key in ("ttft_ms", "total_ms"):
            median, short = statistics.median(t[key] for t in warm), key.removesuffix("_ms")
            row |= {f"first_{key}": round(first[key], 2), f"warm_{key}": round(median, 2),
                    f"new_{key}": round(new[kind][key], 2),
                    f"first_over_warm_{short}": round(first[key] / median, 3),
                    f"new_over_warm_{short}": round(new[kind][key] / median, 3)}  # fmt: skip
        result[kind] = row
    return result


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3), "all": values}  # fmt: skip


def summarize(rounds: list[dict]) -> dict:
    """Per kind, each ratio's median and spread over the rounds; start-up time likewise."""
    metrics: dict = {"startup_s": spread([r["startup_s"] for r in rounds])}
    for kind in KINDS:
        metrics[kind] = {}
        for key in rounds[0][kind]:
            metrics[kind][key] = spread([r[kind][key] for r in rounds])
    metrics["rounds"] = rounds
    return metrics


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="what toppings-serve --model takes")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rank", type=int, default=16, help="the adapter's rank")
    p.add_argument("--rounds", type=int, default=3, help="fresh servers, one after the other")
    p.add_argument("--warm", type=int, default=5, help="warm requests of each kind a round")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--serve-args", default="", help="more toppings-serve arguments")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds to /health")
    p.add_argument("--quick", action="store_true", help="one short round: " + str(QUICK))
    p.add_argument("--out", default="bench/results/first_request.json")
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    if args.rounds < 1 or args.warm < 1:
        p.error("--rounds and --warm must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model_dir = str(resolve_model_dir(args.model))
    with tempfile.TemporaryDirectory(prefix="first-request-") as tmp:
        adapter = write_random_adapter(Path(tmp) / "lora", model_dir, args.rank, TARGETS, seed=7)
        rounds = []
        for i in range(args.rounds):
            rounds.append(one_round(args, adapter, Path(tmp) / f"serve{i}.log"))
            log.info("round %d: %s", i, rounds[-1])
    metrics = summarize(rounds)
    config = {k: getattr(args, k) for k in ("model", "device", "dtype", "rank", "rounds", "warm",
                                            "prompt_len", "max_tokens", "serve_args")}  # fmt: skip
    config["targets"] = list(TARGETS)
    result = write_result(args.out, "first_request", "bench_first_request",
                          device=describe_device(args.device), config=config,
                          metrics=metrics, argv=argv)  # fmt: skip
    for kind in KINDS:
        print(kind, {k: v["median"] for k, v in metrics[kind].items() if "_over_" in k})
    return result


if __name__ == "__main__":
    main()
