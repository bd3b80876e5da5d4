"""Nothing of ours survives a process that used a pool: not on SIGTERM, not on SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import process_alive
from toppings.cpu_lora import shm

# A process that fills a repository, starts a 1-worker pool, runs a call, reports, then idles.
CHILD = """
import json, sys, time, torch
from toppings.cpu_lora import CpuLoraPool, HostRepository
from cpu_lora_helpers import QKV, make_adapter, tiny_config
repo = HostRepository.create(tiny_config(), 1 << 20)
adapter = make_adapter("a", 4, QKV)
repo.add(adapter)
pool = CpuLoraPool(repo, tiny_config(), 1, max_tokens=16, modules=QKV, tokens_per_core=4)
pool.run(0, torch.randn(8, 128), [(adapter.id, 0, 8)], QKV)
print(json.dumps({"workers": pool.worker_pids()}), flush=True)
time.sleep(120)
"""


def _start_child():
    here = str(Path(__file__).parent)  # for cpu_lora_helpers
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, env=env
    )
    line = child.stdout.readline()
    if not line:
        child.wait()
        pytest.fail(f"the child failed to start a pool (exit {child.returncode})")
    workers = json.loads(line)["workers"]
    assert shm.leftovers(child.pid) and all(process_alive(p) for p in workers)
    return child, workers


def _eventually(check, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_sigterm_removes_shared_memory_and_workers():
    child, workers = _start_child()
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == -signal.SIGTERM  # the default action still ends it
    assert shm.leftovers(child.pid) == []
    assert not any(process_alive(p) for p in workers)


def test_orphaned_workers_clean_up_after_a_killed_parent():
    child, workers = _start_child()
    child.kill()  # no handler runs: the workers notice their parent is gone
    child.wait(timeout=30)
    assert _eventually(lambda: not any(process_alive(p) for p in workers))
    assert _eventually(lambda: shm.leftovers(child.pid) == [])


def test_a_process_with_this_pid_keeps_its_names():
    """Two processes of one pid (each in its own PID namespace, one /dev/shm): their names
    differ by their word, so the orphan sweep of one's workers leaves the other's live
    segments, and a name of this process carries its own word."""
    import posix_ipc

    pid = os.getpid()
    assert shm.new_name("repo").startswith(f"/{shm.PREFIX}-{shm.process_tag()}-")
    assert shm.process_tag().startswith(f"{pid}.")
    gone, kept = (f"/{shm.PREFIX}-{pid}.{word}-0-repo" for word in ("aaaa1111", "bbbb2222"))
    for name in (gone, kept):
        posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=4096).close_fd()
    try:
        assert shm.leftovers(f"{pid}.aaaa1111") == [gone.lstrip("/")]
        shm.unlink_orphans(f"{pid}.aaaa1111")
        names = os.listdir(shm.SHM_DIR)
        assert kept.lstrip("/") in names and gone.lstrip("/") not in names
    finally:
        for name in (gone, kept):
            try:
                posix_ipc.unlink_shared_memory(name)
            except posix_ipc.ExistentialError:
                pass
