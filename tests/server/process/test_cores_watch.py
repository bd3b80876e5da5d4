"""The other processes' CPU time (server/process/cores_watch.py), read from /proc as the thread
governor reads it: another process's work on the engine's cores counts, to the tenth of a
second, and work on other cores does not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from toppings.server.process.cores_watch import others_cpu
from toppings.server.settings import process_cores

BURN = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"


def test_another_processes_work_counts():
    """A child that burns half a second of CPU adds at least that much, less the clock's ticks
    (other processes of the machine only add more)."""
    cores = process_cores()
    before = others_cpu(cores)
    if before is None:
        pytest.skip("no /proc/stat here")
    subprocess.run([sys.executable, "-c", BURN], check=True, timeout=120)
    assert others_cpu(cores) - before >= 0.45


def test_only_the_engines_cores_count():
    """A child pinned to one core counts on that core, not on another (an engine pinned there
    by --device-cores)."""
    cores = sorted(process_cores())
    if len(cores) < 2 or others_cpu(frozenset(cores)) is None:
        pytest.skip("needs two cores and /proc/stat")
    mine, other = frozenset(cores[:1]), frozenset(cores[1:2])
    before = others_cpu(mine), others_cpu(other)
    subprocess.run([sys.executable, "-c", BURN], check=True, timeout=120,
                   preexec_fn=lambda: os.sched_setaffinity(0, mine))  # fmt: skip
    on_mine, on_other = others_cpu(mine) - before[0], others_cpu(other) - before[1]
    assert on_mine >= 0.45 and on_other < on_mine
