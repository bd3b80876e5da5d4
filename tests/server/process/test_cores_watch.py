"""The other processes' CPU time (server/process/cores_watch.py), read from /proc as the thread
governor reads it: another process's work on this one's cores counts, to the tenth of a second."""

from __future__ import annotations

import subprocess
import sys

import pytest

from toppings.server.process.cores_watch import others_cpu

BURN = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"


def test_another_processes_work_counts():
    """A child that burns half a second of CPU adds at least that much, less the clock's ticks
    (other processes of the machine only add more)."""
    before = others_cpu()
    if before is None:
        pytest.skip("no /proc/stat here")
    subprocess.run([sys.executable, "-c", BURN], check=True, timeout=120)
    assert others_cpu() - before >= 0.45
