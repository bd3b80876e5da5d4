"""One OpenMP team in the process: the engine thread's.

torch (and the native kernels, `server/native`) run parallel ops on OpenMP, and libgomp gives
every thread that starts a parallel region a team of worker threads of its own, kept for that
thread's life. While the process holds more such workers than it has cores, libgomp stops letting
idle workers spin (`gomp_throttled_spin_count_var`: a handful of spins instead of milliseconds'
worth): every parallel region of a decode step (the GEMVs, attention, norms) then wakes its worker
through the kernel, and a decode step on a thread of its own ran markedly slower after the main
thread had started a team than when none had (or when the model was loaded on a thread that had
ended: a thread's team ends with it; docs/benchmarks.md, "Measurements behind the code").

So the server keeps one team: the engine thread's (`Engine._loop` sets its count explicitly,
whatever another thread set last). The model is loaded on a thread that ends
(`run_in_passing_thread`); every other long-lived thread that may run a large torch op (the
adapter admin and adapter loader threads, the grammar mask thread, the HTTP main thread once
the model is up) runs torch on itself alone (`torch_on_this_thread_only`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from toppings.server.config import EngineConfig

T = TypeVar("T")


def engine_thread_count(config: EngineConfig) -> int:
    """The engine thread's OpenMP team: `--torch-threads` where set, else the cores it is bound
    to, else the count torch gives the calling thread."""
    return config.num_threads or len(config.device_cores) or torch.get_num_threads()


def set_torch_threads(count: int) -> None:
    """This thread's torch ops run on `count` threads. ATen gives a thread the process-wide
    count (the last one set, by any thread) at its first parallel op unless it has asked for
    its own count before: ask first, then set."""
    torch.get_num_threads()
    torch.set_num_threads(count)


def enter_engine_thread(count: int, cores: tuple[int, ...] | None) -> None:
    """Set up the calling thread as the engine thread, before its first torch op: bound to
    `cores` when given (the device side of a CPU split; affinity is per thread, and the OpenMP
    team the thread creates inherits it), its torch ops on `count` threads (always: another
    thread may have set the process-wide count to 1 before)."""
    if cores:
        os.sched_setaffinity(0, cores)
    set_torch_threads(count)


def torch_on_this_thread_only() -> None:
    """This thread never starts an OpenMP team: its torch ops run on it alone. Threads started
    later that never set a count of their own get 1 too (ATen's process-wide count)."""
    set_torch_threads(1)


def run_in_passing_thread(fn: Callable[..., T], *args: object, threads: int) -> T:
    """fn(*args) on a new thread with `threads` torch threads, which ends when fn returns, and
    with it its OpenMP team; fn's result, or its exception raised here."""
    box: dict[str, object] = {}

    def run() -> None:
        set_torch_threads(threads)
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="model-load", daemon=True)  # Ctrl-C: no wait
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]
