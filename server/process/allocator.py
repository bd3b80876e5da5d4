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

glibc also keeps a cache of freed small blocks in every thread (tcache), which it counts in use
and neither trims nor shares. It is left as glibc sets it: when waitress woke its handler threads
in turn, each filled a cache of its own and the heap grew (issue 48); now that they are woken
last-in first-out (server/http/waitress_server.py), a soak with the caches on stays flat
(bench/results/soak_tcache_on.json), and turning them off made decoding over many streams
slower (bench/results/tcache_single_stream.json). An operator's GLIBC_TUNABLES still applies.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # mallopt parameter (malloc.h)
MAX_ARENAS = 2
TRIM_INTERVAL_S = 60.0
ONEDNN_CACHE_ENTRIES = 16
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


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
