"""How much of this process's cores the machine's other processes use: `CoresWatch`.

The thread governor (thread_governor.py) reads it to see a neighbour crowd its team or leave:
the CPU time every other process used on the engine thread's cores (/proc/stat's busy time of
those cores less this process's own, which its threads on other cores make an underestimate),
over a window of a quarter of a second. Reading it costs some 50 us on a 2-core EPYC, so it is read
once a window, not each step. Measured there from a process running torch on both cores: a
setsid busy loop beside it 1.01 cores, the quiet machine 0.01-0.02.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

_TICKS = os.sysconf("SC_CLK_TCK")  # the unit of /proc/stat and /proc/self/stat


class CoresWatch:
    """The other processes' use of the engine's cores over windows of `window` seconds (made
    `longer` after a probe they started changed nothing, up to 8x; `reset` at a change)."""

    def __init__(
        self, cores: frozenset[int], threads: int, window: float = 0.25,
        others: Callable[[], float | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        """cores: the engine thread's; threads: its team's, the rest of `cores` left to others
        (the CPU workers') and not counted; others: the CPU seconds the other processes have
        used on `cores` (None: unknown), default `others_cpu`'s; clock: seconds."""
        self._spare, self._window, self._wait = max(0, len(cores) - threads), window, window
        self._others = others or (lambda: others_cpu(cores))
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


def others_cpu(cores: frozenset[int]) -> float | None:
    """The CPU seconds every process but this one has used since boot on `cores` (the busy time
    of their /proc/stat lines, steal included, less /proc/self/stat's user and system time), or
    None where they cannot be read."""
    names, busy = {f"cpu{i}" for i in cores}, 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                fields = line.split()
                if not fields[0].startswith("cpu"):
                    break
                if fields[0] in names:  # not idle, iowait, guest (counted in user)
                    busy += sum(int(fields[i]) for i in (1, 2, 3, 6, 7, 8))
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
        mine = int(own[11]) + int(own[12])  # utime, stime: fields 14 and 15 of proc(5)
    except (OSError, ValueError, IndexError):
        return None
    return (busy - mine) / _TICKS
