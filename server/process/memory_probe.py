"""A debugging probe of where a server's memory goes over hours (issue 48's soak).

Off unless `TOPPINGS_MEMORY_PROBE=FILE` is set in the server's environment: then a daemon thread
appends one JSON line to FILE every `TOPPINGS_MEMORY_PROBE_INTERVAL` seconds (default 60) with
the process's memory as the kernel sees it (/proc/self/smaps_rollup: anonymous, file-backed,
private dirty) and its thread count, glibc's heap (mallinfo2: bytes in use, free inside the
arenas, mmapped), the live Python objects by type (the 15 most numerous), with
`TOPPINGS_MEMORY_PROBE_TYPES=Name,Name` the live objects of those types after a full
collection, and, once `TOPPINGS_MEMORY_PROBE_TRACE_AFTER` seconds have passed (default: never),
the Python allocation sites that grew most since tracing began (tracemalloc, 8 frames; it slows
the server while on). Growth that glibc counts in use but tracemalloc does not is native
(torch, oneDNN, threads' own caches); growth of RSS beyond glibc's in-use bytes is
fragmentation or pages outside malloc (thread stacks, Python's own arenas).
"""

from __future__ import annotations

import collections
import ctypes
import gc
import json
import logging
import os
import threading
import time
import tracemalloc
from pathlib import Path

log = logging.getLogger(__name__)

PROBE_VARIABLE = "TOPPINGS_MEMORY_PROBE"
TRACE_FRAMES = 8
NUM_SITES = 25
NUM_TYPES = 15


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
            "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _glibc_heap() -> dict[str, int]:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
    except (OSError, AttributeError):
        return {}
    info = libc.mallinfo2()
    return {
        "in_use": info.uordblks + info.hblkhd,
        "free_in_arenas": info.fordblks,
        "arena_bytes": info.arena,
        "mmapped": info.hblkhd,
    }


def _kernel_view() -> dict[str, int]:
    """KiB by kind from /proc/self/smaps_rollup."""
    keep = ("Rss", "Anonymous", "Private_Dirty", "Shared_Clean", "Private_Clean", "Swap")
    out = {}
    try:
        status = Path("/proc/self/status").read_text().splitlines()
        out["threads"] = next(int(s.split()[1]) for s in status if s.startswith("Threads:"))
    except (OSError, StopIteration):
        pass
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
            key, _, rest = line.partition(":")
            if key in keep:
                out[key] = int(rest.split()[0])
    except OSError:
        pass
    return out


def _types() -> list[tuple[str, int]]:
    counts = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
    return counts.most_common(NUM_TYPES)


def _watched(names: list[str]) -> dict[str, int]:
    """Live objects of the named types (after a full collection: what is really held)."""
    gc.collect()
    counts = dict.fromkeys(names, 0)
    for o in gc.get_objects():
        name = type(o).__qualname__
        if name in counts:
            counts[name] += 1
    return counts


def _sites(base: tracemalloc.Snapshot) -> list[dict]:
    now = tracemalloc.take_snapshot()
    stats = now.compare_to(base, "traceback")[:NUM_SITES]
    return [
        {
            "kib": round(s.size_diff / 1024, 1),
            "count": s.count_diff,
            "where": [f"{f.filename}:{f.lineno}" for f in s.traceback][-TRACE_FRAMES:],
        }
        for s in stats
    ]


def start_memory_probe() -> bool:
    """Start the probe thread if the environment asks for it; returns whether it started."""
    path = os.environ.get(PROBE_VARIABLE)
    if not path:
        return False
    interval = float(os.environ.get(f"{PROBE_VARIABLE}_INTERVAL", "60"))
    trace_after = float(os.environ.get(f"{PROBE_VARIABLE}_TRACE_AFTER", "inf"))
    t0 = time.monotonic()

    def run() -> None:
        base: tracemalloc.Snapshot | None = None
        while True:
            time.sleep(interval)
            elapsed = time.monotonic() - t0
            line: dict = {"t": round(elapsed, 1), "kernel_kib": _kernel_view()}
            line |= {"glibc": _glibc_heap(), "types": _types()}
            watch = os.environ.get(f"{PROBE_VARIABLE}_TYPES")
            if watch:
                line["watched"] = _watched(watch.split(","))
            if base is None and elapsed >= trace_after:
                tracemalloc.start(TRACE_FRAMES)
                base = tracemalloc.take_snapshot()
            elif base is not None:
                line["traced_kib"] = tracemalloc.get_traced_memory()[0] // 1024
                line["sites"] = _sites(base)
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")

    threading.Thread(target=run, name="memory-probe", daemon=True).start()
    log.info("memory probe writing to %s every %.0f s", path, interval)
    return True
