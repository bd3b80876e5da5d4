"""One hostile body against a whole process: `toppings-serve` and `toppings-scheduler` each get
issue 67's body (brackets past the depth bound, then an unterminated string of escaped quotes) at
the largest size they accept, in the body and inside fields (`guided_json` text, a tool call's
arguments), while a second client asks `/health` every `--poll-ms`; writes
bench/results/hostile_body.json.

Reported per case: the answer's status and seconds, and the slowest and median `/health` answer
while it was in flight (the bound: a request may cost its own time, never the process's). Beside
them, in this process, the depth scan against the regex it replaced on the same body at small
sizes, where the regex still ends (quadratic: 64 KB took 24 s in issue 67's probe).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from bench.bench_single_stream import stop_all, wait_healthy
from bench.common import free_port
from bench.envelope import describe_device, write_result
from toppings.scheduler.app import MAX_BODY_BYTES
from toppings.server.requests.json_depth import nests_too_deep

log = logging.getLogger(__name__)

# The string cut of the depth scan before issue 67, kept here only to measure what it cost.
OLD_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def hostile_text(size: int) -> bytes:
    """Issue 67's text: 130 brackets, then an unterminated string of escaped quotes, `size` bytes
    in all (the caller puts it in a body or a field)."""
    head = b"[" * 130 + b'"'
    return head + b'\\"' * ((size - len(head)) // 2)


def bodies(limit: int, with_tools: bool) -> dict[str, tuple[str, bytes]]:
    """The cases at `limit` bytes: {name: (path, body)}."""
    room = limit - 512  # the JSON around the hostile text
    field = hostile_text(room // 2).decode()  # JSON-escaped, each `\"` grows to `\\\"`
    cases = {
        "body": ("/v1/completions", b'{"prompt": [' + hostile_text(room)),
        "guided_json": (
            "/v1/completions",
            json.dumps({"prompt": "hi", "max_tokens": 1, "guided_json": field}).encode(),
        ),
    }
    if with_tools:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": field}}
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
        body = json.dumps({"messages": messages, "max_tokens": 1}).encode()
        cases["tool_arguments"] = ("/v1/chat/completions", body)
    for _, body in cases.values():
        assert len(body) <= limit, (len(body), limit)
    return cases


def server_limit(url: str) -> int:
    """The server's body limit, read from its 413 answer to a body one byte per limit over."""
    answer = requests.post(url + "/v1/completions", data=b"x" * (64 << 20), timeout=60)
    match = re.search(r"limit of (\d+) bytes", answer.json()["error"]["message"])
    assert answer.status_code == 413 and match, answer.text[:200]
    return int(match.group(1))


def under_fire(url: str, path: str, body: bytes, poll_s: float) -> dict:
    """Send `body` to `url + path` while another thread asks /health every `poll_s`."""
    done = threading.Event()
    health_ms: list[float] = []

    def poll() -> None:
        while not done.is_set():
            start = time.perf_counter()
            requests.get(url + "/health", timeout=120)
            health_ms.append((time.perf_counter() - start) * 1e3)
            time.sleep(poll_s)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    time.sleep(4 * poll_s)  # the poller's connection is open before the body arrives
    start = time.perf_counter()
    answer = requests.post(url + path, data=body, timeout=600,
                           headers={"content-type": "application/json"})  # fmt: skip
    seconds = time.perf_counter() - start
    done.set()
    poller.join()
    return {
        "bytes": len(body),
        "status": answer.status_code,
        "message": answer.json()["error"]["message"][:120] if answer.status_code >= 400 else "",
        "seconds": round(seconds, 3),
        "health_max_ms": round(max(health_ms), 1),
        "health_p50_ms": round(statistics.median(health_ms), 1),
        "health_polls": len(health_ms),
    }


def scan_vs_regex(sizes: list[int]) -> list[dict]:
    """In process: the depth scan and the old string regex on the same hostile body."""
    rows = []
    for size in sizes:
        body = b'{"prompt": [' + hostile_text(size)
        start = time.perf_counter()
        assert nests_too_deep(body)
        scan_s = time.perf_counter() - start
        start = time.perf_counter()
        OLD_STRING.sub(b"", body)
        regex_s = time.perf_counter() - start
        rows.append({"bytes": len(body), "scan_ms": round(scan_s * 1e3, 2),
                     "old_regex_ms": round(regex_s * 1e3, 1)})  # fmt: skip
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="what toppings-serve --model takes")
    p.add_argument("--rounds", type=int, default=3, help="each case sent this many times")
    p.add_argument("--poll-ms", type=float, default=10.0, help="gap between /health asks")
    p.add_argument("--regex-sizes", default="4096,8192,16384",
                   help="body sizes for the in-process scan / old regex comparison")  # fmt: skip
    p.add_argument("--out", default="bench/results/hostile_body.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hostile_body_"))
    server_port, scheduler_port = free_port(), free_port()
    server_url = f"http://127.0.0.1:{server_port}"
    scheduler_url = f"http://127.0.0.1:{scheduler_port}"
    procs = [
        subprocess.Popen([sys.executable, "-m", "toppings.server.cli", "--model", args.model,
                          "--port", str(server_port)], stdout=open(work / "server.log", "w"),
                         stderr=subprocess.STDOUT, start_new_session=True),
        subprocess.Popen([sys.executable, "-m", "toppings.scheduler.cli", "--registry",
                          str(work / "registry.sqlite"), "--port", str(scheduler_port)],
                         stdout=open(work / "scheduler.log", "w"), stderr=subprocess.STDOUT,
                         start_new_session=True),
    ]  # fmt: skip
    try:
        wait_healthy(server_url, procs[0], work / "server.log", 600)
        time.sleep(1.0)  # the scheduler's own start; it is healthy once it knows a server
        answer = requests.post(scheduler_url + "/admin/servers", json={"url": server_url})
        answer.raise_for_status()
        wait_healthy(scheduler_url, procs[1], work / "scheduler.log", 120)
        targets = {
            "server": (server_url, bodies(server_limit(server_url), with_tools=True)),
            "scheduler": (scheduler_url, bodies(MAX_BODY_BYTES, with_tools=False)),
        }
        cases: dict[str, list[dict]] = {}
        for round_idx in range(args.rounds):
            for target, (url, target_bodies) in targets.items():
                for case, (path, body) in target_bodies.items():
                    row = under_fire(url, path, body, args.poll_ms / 1e3)
                    log.info("round %d %s %s: %s", round_idx, target, case, row)
                    cases.setdefault(f"{target}/{case}", []).append(row)
    finally:
        stop_all(procs)
    metrics = {
        name: {
            "bytes": rows[0]["bytes"],
            "statuses": sorted({r["status"] for r in rows}),
            "message": rows[0]["message"],
            "seconds_max": max(r["seconds"] for r in rows),
            "health_max_ms": max(r["health_max_ms"] for r in rows),
            "health_p50_ms": statistics.median(r["health_p50_ms"] for r in rows),
            "rounds": rows,
        }
        for name, rows in cases.items()
    }
    sizes = [int(s) for s in args.regex_sizes.split(",") if s]
    metrics["in_process_scan_vs_old_regex"] = scan_vs_regex(sizes)
    write_result(args.out, "hostile_body", "bench_hostile_body", device=describe_device("cpu"),
                 config={"model": args.model, "rounds": args.rounds, "poll_ms": args.poll_ms},
                 metrics=metrics)  # fmt: skip
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
