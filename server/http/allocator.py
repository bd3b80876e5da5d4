"""glibc's allocator for a long-running server: few arenas, free pages given back.

glibc gives each thread that allocates an arena of its own, up to 8 per core, and keeps the
pages a free leaves inside an arena. A server's many handler threads (one per request in flight)
each hold such pages, and RSS creeps up as allocation sizes vary over hours although the memory
in use does not. Here the arenas are capped (`M_ARENA_MAX`, as `MALLOC_ARENA_MAX` would, unless
the operator set that) and a daemon thread calls `malloc_trim(0)` every `TRIM_INTERVAL_S`, which
returns every free page of every arena to the kernel. Neither changes what is allocated; on a
libc other than glibc both are skipped.
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
