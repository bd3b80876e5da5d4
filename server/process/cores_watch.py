"""How much of this process's cores the machine's other processes use: `CoresWatch`.

The thread governor (thread_governor.py) reads it on fewer threads than cores, where a
neighbour's leaving does not show in its steps: the CPU time every other process used on the
cores this one may run on (/proc/stat's busy time of those cores less this process's own), over
a window of a quarter of a second. Reading it costs some 50 us on a 2-core EPYC, so it is read
once a window, not each step. Measured there from a process running torch on both cores: a
setsid busy loop beside it 1.01 cores, the quiet machine 0.01-0.02.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

_TICKS = os.sysconf("SC_CLK_TCK")  # the unit of /proc/stat and /proc/self/stat


def affinity_cores() -> int:
    """The cores this process may run on (every core where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class CoresWatch:
    """The other processes' use of this process's cores over windows of `window` seconds (made
    `longer` after a probe they started changed nothing, up to 8x; `reset` at a change)."""

    def __init__(
        self, spare: int, window: float = 0.25,
        others: Callable[[], float | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        """spare: cores the engine leaves (the CPU workers'), not counted; others: the CPU
        seconds the others have used (None: unknown), default `others_cpu`; clock: seconds."""
        self._spare, self._window, self._wait = spare, window, window
        self._others = others or others_cpu
        self._clock = clock
        self._mark: tuple[float, float] | None = None  # (clock, others) when the window began

    def read(self) -> float | None:
        """The cores' worth the others used past the spare ones over the window that ends now
        (a new one begins), or None where none does (the first read begins one)."""
        now = self._clock()
        if self._mark is not None and now - self._mark[0] < self._wait:
            return None
        cpu, mark = self._others(), self._mark
        self._mark = None if cpu is None else (now, cpu)
        if cpu is None or mark is None:
            return None
        return (cpu - mark[1]) / (now - mark[0]) - self._spare

    def restart(self) -> None:
        """Begin the next window at the next read."""
        self._mark = None

    def longer(self) -> None:
        self._wait = min(2 * self._wait, 8 * self._window)

    def reset(self) -> None:
        self._wait = self._window


def others_cpu() -> float | None:
    """The CPU seconds every process but this one has used since boot on the cores this one may
    run on (the busy time of their /proc/stat lines, steal included, less /proc/self/stat's user
    and system time), or None where they cannot be read."""
    busy = 0
    try:
        cores = {f"cpu{i}" for i in os.sched_getaffinity(0)}  # Linux's, as /proc is
        with open("/proc/stat") as f:
            for line in f:
                fields = line.split()
                if not fields[0].startswith("cpu"):
                    break
                if fields[0] in cores:  # not idle, iowait, guest (counted in user)
                    busy += sum(int(fields[i]) for i in (1, 2, 3, 6, 7, 8))
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
        mine = int(own[11]) + int(own[12])  # utime, stime: fields 14 and 15 of proc(5)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return (busy - mine) / _TICKS
