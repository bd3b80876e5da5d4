"""Native memory of a long-running server: glibc's allocator (few arenas, free pages given
back) and oneDNN's shape caches (bounded). Both are set once, at start-up, before the model loads.

glibc gives each thread that allocates an arena of its own, up to 8 per core, and keeps the
pages a free leaves inside an arena. A server's many handler threads (one per request in flight)
each hold such pages, and RSS creeps up as allocation sizes vary over hours although the memory
in use does not. Here the arenas are capped (`M_ARENA_MAX`, as `MALLOC_ARENA_MAX` would, unless
the operator set that) and a daemon thread calls `malloc_trim(0)` every `TRIM_INTERVAL_S`, which
returns every free page of every arena to the kernel. Neither changes what is allocated; on a
libc other than glibc both are skipped.

oneDNN, and ideep above it in torch, keep a compiled primitive for each input shape they meet in
an LRU cache each (1024 entries by default). The rows of a projection are the step's token
count, so a server meets new shapes for hours and every one stays: that grew the soak's RSS
(bench/soak.py, issue 48). `bound_onednn_caches` bounds both to ONEDNN_CACHE_ENTRIES: a server
fills them within its first minute (at 128 the soak's RSS still grew after 40 minutes: an
entry's size grows with the rows, and the large shapes displace the small). A shape missing from
the cache costs one primitive creation per weight shape of the step, small beside the product at
the rows where oneDNN runs. An operator's own values of the variables are kept.

glibc also keeps a cache of freed small blocks in every thread (tcache: up to 7 blocks of each of
64 sizes up to 1 KiB), which it counts in use and neither trims nor shares. waitress's handler
threads (one per request in flight, 520 by default) wake in turn, so each slowly fills its own:
the soak's heap grew about 3 MB a minute with the thread count flat, and stayed flat with the
caches off (issue 48). `tcache_off_environment` gives the environment that turns them off
(`GLIBC_TUNABLES=glibc.malloc.tcache_count=0`); glibc reads it only when a process starts, so
`toppings-serve` re-executes itself with it (same pid and command line) unless the operator set
`glibc.malloc.tcache_count` already.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # mallopt parameter (malloc.h)
MAX_ARENAS = 2
TRIM_INTERVAL_S = 60.0
ONEDNN_CACHE_ENTRIES = 16
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


TCACHE_TUNABLE = "glibc.malloc.tcache_count"


def tcache_off_environment(env: dict[str, str]) -> dict[str, str] | None:
    """`env` with glibc's per-thread caches turned off, or None where there is nothing to do:
    not glibc, or GLIBC_TUNABLES names the tcache already (the operator's, or set by us)."""
    if _glibc() is None:
        return None
    tunables = env.get("GLIBC_TUNABLES", "")
    if TCACHE_TUNABLE in tunables:
        return None
    return env | {"GLIBC_TUNABLES": ":".join(filter(None, (tunables, f"{TCACHE_TUNABLE}=0")))}


def restart_without_tcache() -> None:
    """Re-execute this process's command line with glibc's per-thread caches off, where
    `tcache_off_environment` says so; returns where it does not. Call it first thing, before
    any thread or file is opened."""
    env = tcache_off_environment(dict(os.environ))
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)


def bound_onednn_caches() -> None:
    """Set the oneDNN and ideep shape caches to ONEDNN_CACHE_ENTRIES unless set already; both
    read their variable at their first use, so this must run before the first oneDNN op."""
    for variable in ONEDNN_CACHE_VARIABLES:
        os.environ.setdefault(variable, str(ONEDNN_CACHE_ENTRIES))


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018 - both exist on glibc only
    except (OSError, AttributeError):
        return None
    return libc


def tune_allocator(stop: threading.Event | None = None) -> bool:
    """Cap glibc's arenas and start the trimming thread (it ends with `stop`, else with the
    process); returns whether glibc was found."""
    libc = _glibc()
    if libc is None:
        log.info("not glibc: the allocator is left as it is")
        return False
    if "MALLOC_ARENA_MAX" not in os.environ:
        libc.mallopt(M_ARENA_MAX, MAX_ARENAS)
    stop = stop or threading.Event()

    def trim() -> None:
        while not stop.wait(TRIM_INTERVAL_S):
            libc.malloc_trim(0)

    threading.Thread(target=trim, name="malloc-trim", daemon=True).start()
    return True
