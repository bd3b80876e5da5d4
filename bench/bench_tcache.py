"""What glibc's per-thread caches off (`tcache_count=0`) cost in decode speed against glibc's
default (on, as toppings-serve runs): client TPOT at batch 1 and over 16 concurrent streams.

    python -m bench.bench_tcache [--rounds 3] [--max-tokens 48]

Two `toppings-serve --model smollm2` run side by side: one started with
`GLIBC_TUNABLES=glibc.malloc.tcache_count=0`, one as shipped (no GLIBC_TUNABLES: glibc's default
count, 7; until session 27 toppings-serve turned the caches off itself, re-executing with that
variable). Rounds alternate: in each round both servers run both rows (batch 1: `--single`
requests one after the other; batch 16: 16 streamed requests at once), in an order that flips
every round, so that a shared machine's neighbours weigh on both alike. A request is a fresh
prompt of random token ids (no prefix cache hit) and `--max-tokens` new tokens with `ignore_eos`;
its TPOT is the client's time from its first streamed token to its last over the tokens between
(bench_single_stream.stream_tpot). Reported: per row and server the median over rounds of the
round's median TPOT, and the ratio off / on.
Writes bench/results/tcache.json.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import requests

from bench.bench_single_stream import run_row, spread, stop_all, wait_healthy
from bench.envelope import describe_device, write_result

log = logging.getLogger("bench_tcache")

TUNABLE = "glibc.malloc.tcache_count"
VARIANTS = {"tcache_off": f"{TUNABLE}=0", "tcache_on": None}  # None: as shipped


def server_tunables(pid: int) -> str:
    """GLIBC_TUNABLES as the server process has it."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    found = [e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"GLIBC_TUNABLES=")]
    return found[0] if found else ""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--single", type=int, default=3, help="batch-1 requests a round")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--port", type=int, default=8481)
    p.add_argument("--out", default="bench/results/tcache.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    work = Path(tempfile.mkdtemp(prefix="bench-tcache-"))
    procs, urls, tunables = [], {}, {}
    try:
        for i, (name, value) in enumerate(VARIANTS.items()):
            env = dict(os.environ)
            env.pop("GLIBC_TUNABLES", None)
            if value is not None:
                env["GLIBC_TUNABLES"] = value
            port = args.port + i
            with open(work / f"{name}.log", "w") as f:
                cmd = [sys.executable, "-m", "toppings.server.cli", "--model", "smollm2"]
                proc = subprocess.Popen(
                    [*cmd, "--port", str(port)],
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=env,
                )
            procs.append(proc)
            urls[name] = f"http://127.0.0.1:{port}"
            wait_healthy(urls[name], proc, work / f"{name}.log", 900.0)
            tunables[name] = server_tunables(proc.pid)
            log.info("%s up, GLIBC_TUNABLES=%r", name, tunables[name])
        model = requests.get(urls["tcache_off"] + "/v1/models", timeout=30).json()["data"][0]["id"]
        rng = random.Random(0)

        def prompts(n: int) -> list[list[int]]:
            return [[rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(n)]

        for url in urls.values():  # warm-up: shapes and caches of both rows
            run_row(url, model, prompts(args.streams), 8)
        rows: dict[str, dict[str, list[float]]] = {
            name: {"batch_1": [], f"batch_{args.streams}": []} for name in VARIANTS
        }
        for r in range(args.rounds):
            order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                single = [
                    run_row(urls[name], model, prompts(1), args.max_tokens)["tpot_ms"]
                    for _ in range(args.single)
                ]
                rows[name]["batch_1"].append(statistics.median(single))
                many = run_row(urls[name], model, prompts(args.streams), args.max_tokens)
                rows[name][f"batch_{args.streams}"].append(many["tpot_ms"])
                log.info("round %d %s: %s", r, name, {k: v[-1] for k, v in rows[name].items()})
    finally:
        stop_all(procs)
    tpot = {name: {k: spread(v) for k, v in row.items()} for name, row in rows.items()}
    metrics: dict = {"tpot_ms": tpot}
    metrics["ratio_off_over_on"] = {
        k: round(
            statistics.median(rows["tcache_off"][k]) / statistics.median(rows["tcache_on"][k]), 3
        )
        for k in rows["tcache_off"]
    }
    config = vars(args) | {"server_glibc_tunables": tunables, "model": "smollm2"}
    write_result(
        args.out, "tcache", "tcache", device=describe_device(), config=config, metrics=metrics
    )
    log.info("%s", metrics)


if __name__ == "__main__":
    main()
