"""Taking a semaphore by spinning first: a post that comes soon is seen without a wake-up.

A blocked `sem_wait` costs a scheduler wake-up on the post (tens of microseconds, more on a
VM whose idle vCPU has to be woken). When the other side answers within a short window, a
`sem_trywait` loop (user space only, no system call while the count is zero) sees the post at
once. Spinning burns the core it runs on, so it is bounded and off by default: worth it when
the workers own their cores (a GPU node), not when they share them with the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import posix_ipc


def try_acquire_spinning(sem: posix_ipc.Semaphore, spin_ns: int) -> bool:
    """Take `sem` if it is posted within `spin_ns` nanoseconds; False (not taken) otherwise."""
    end = time.perf_counter_ns() + spin_ns
    while True:
        try:
            sem.acquire(0)
            return True
        except posix_ipc.BusyError:
            if time.perf_counter_ns() >= end:
                return False


def spin_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    """Poll `predicate` without sleeping until it holds (True) or timeout_s passes (False)."""
    if predicate():
        return True
    end = time.perf_counter_ns() + int(timeout_s * 1e9)
    while time.perf_counter_ns() < end:
        if predicate():
            return True
    return False
