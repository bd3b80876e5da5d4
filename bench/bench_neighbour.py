"""One stream beside a busy neighbour: time per output token (TPOT) of `toppings-serve` with
its thread governor (`--adapt-threads on`, server/process/thread_governor.py) and without, on a
quiet machine and beside `--neighbours` processes that each keep a core busy; writes
bench/results/neighbour.json.

The neighbour is what a shared host has: a busy process of another session (`setsid`: with
Linux's autogroup, `nice` ranks processes within a session only, so a low-priority compile
started from another terminal takes a core's fair share all the same). It runs only during the
busy phase of each round and is stopped after it.

Rounds alternate: each round runs the quiet and the busy phase (in an order that flips every
round), and in each phase every server one request after another (order flipping too), each a
fresh `--prompt-len`-token prompt and `--max-tokens` new tokens, streamed; a request's TPOT is
the client's time from its first streamed token to its last over the tokens between (as
bench_single_stream.py). Reported per server and phase: the median round and its spread, and
the ratios busy / quiet and governor on / off. llama.cpp's server (`--llama-server`, `--gguf`)
runs in the same rounds where given, at its own thread setting (`-t` = `--threads`).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import requests

from bench.bench_long_prompt import cpu_flags
from bench.bench_single_stream import (
    run_row,
    spread,
    start_llama,
    start_server,
    stop_all,
    wait_healthy,
)
from bench.common import free_port
from bench.envelope import describe_device, write_result

log = logging.getLogger(__name__)

BUSY_LOOP = "while True: pass"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="what toppings-serve --model takes")
    p.add_argument("--dtype", default="auto", help="toppings-serve --dtype")
    p.add_argument("--neighbours", type=int, default=1, help="busy processes in the busy phase")
    p.add_argument("--rounds", type=int, default=4, help="timed rounds after one warm-up round")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="toppings-serve --torch-threads and llama-server -t")  # fmt: skip
    p.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server")
    p.add_argument("--gguf", type=Path, default=None, help="its GGUF, at the served precision")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results/neighbour.json"))
    return p.parse_args(argv)


def start_neighbours(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], start_new_session=True)
            for _ in range(count)]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    work = Path(tempfile.mkdtemp(prefix="neighbour_"))
    servers: dict[str, tuple[str, str | None]] = {}  # name -> (url, model name; None: llama)
    procs: list[subprocess.Popen] = []
    try:
        for name, governor in (("governor_on", "on"), ("governor_off", "off")):
            port = free_port()
            log_path = work / f"{name}.log"
            procs.append(start_server(sys.executable, [
                "--model", args.model, "--dtype", args.dtype, "--port", str(port),
                "--torch-threads", str(args.threads), "--adapt-threads", governor,
            ], log_path))  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, procs[-1], log_path, 600)
            served = requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
            servers[name] = (url, served)
        if args.llama_server and args.gguf:
            port = free_port()
            log_path = work / "llama.log"
            procs.append(start_llama(args.llama_server, args.gguf, port, 2048, args.threads,
                                     log_path))  # fmt: skip
            servers["llama_server"] = (f"http://127.0.0.1:{port}", None)
            wait_healthy(servers["llama_server"][0], procs[-1], log_path, 600)
        rng = random.Random(args.seed)
        times: dict[tuple[str, str], list[float]] = {}
        for round_idx in range(args.rounds + 1):
            phases = ["quiet", "busy"] if round_idx % 2 == 0 else ["busy", "quiet"]
            for phase in phases:
                hogs = start_neighbours(args.neighbours) if phase == "busy" else []
                try:
                    order = list(servers) if round_idx % 2 == 0 else list(reversed(servers))
                    for name in order:
                        url, model = servers[name]
                        prompt = [rng.randrange(100, 20000) for _ in range(args.prompt_len)]
                        tpot = run_row(url, model, [prompt], args.max_tokens)["tpot_ms"]
                        log.info("round %d %s %s: %.1f ms", round_idx, phase, name, tpot)
                        if round_idx:  # round 0 warms up
                            times.setdefault((name, phase), []).append(tpot)
                finally:
                    stop_all(hogs)
        switches = (work / "governor_on.log").read_text(errors="replace").count("steps run on")
    finally:
        stop_all(procs)
    metrics: dict = {"tpot_ms_batch1": {}, "busy_over_quiet": {}, "governor_switches": switches}
    for name in servers:
        row = {phase: spread(times[name, phase]) for phase in ("quiet", "busy")}
        metrics["tpot_ms_batch1"][name] = row
        metrics["busy_over_quiet"][name] = round(row["busy"]["median"] / row["quiet"]["median"], 2)
    for phase in ("quiet", "busy"):
        on, off = (metrics["tpot_ms_batch1"][n][phase]["median"]
                   for n in ("governor_on", "governor_off"))  # fmt: skip
        metrics[f"governor_on_over_off_{phase}"] = round(on / off, 3)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["cpu_flags"] = cpu_flags()
    write_result(args.out, "neighbour", "bench_neighbour", device=describe_device("cpu"),
                 config=config, metrics=metrics, argv=argv)  # fmt: skip
    log.info("%s", metrics)
    return 0


if __name__ == "__main__":
    sys.exit(main())
