"""Adapter loads run on one thread and unloads on another, not on the HTTP handler thread that
asked (issue 48's soak): OpenMP keeps a team of worker threads for every thread that ran a
parallel torch op, so hundreds of long-lived handler threads that each loaded an adapter kept
hundreds of teams."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from toppings.server.api.admin.lifecycle import AdapterAdmin, AdapterPaths

NUM_CALLERS = 8


def _native_only_threads() -> int:
    """Threads of this process that Python did not start (OpenMP's workers)."""
    with open("/proc/self/status") as f:
        total = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return total - threading.active_count()


class RecordingEngine:
    """The tiny engine, with the thread of each adapter table change recorded; `parallel_op`:
    also run a torch op large enough to start an OpenMP parallel region."""

    def __init__(self, engine, parallel_op: bool = False):
        self._engine = engine
        self._parallel_op = parallel_op
        self.threads: dict[str, list[int]] = {"load": [], "unload": []}

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def _record(self, kind: str) -> None:
        self.threads[kind].append(threading.get_ident())
        if self._parallel_op:
            torch.ones(1 << 22).mul_(2.0)

    def add_adapter(self, name: str, path: str):
        self._record("load")
        return self._engine.add_adapter(name, path)

    def remove_adapter(self, name: str) -> None:
        self._record("unload")
        self._engine.remove_adapter(name)


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory, tiny_model_dir):
    from toppings.scripts.make_adapters import make_random_adapter

    root = tmp_path_factory.mktemp("adapter_thread")
    make_random_adapter(root / "a", tiny_model_dir, rank=4, seed=1)
    return root


def _from_live_threads(admin: AdapterAdmin, root) -> tuple[list[int], int]:
    """Load and unload an adapter from NUM_CALLERS threads that stay alive until every one has
    run (as waitress's handler threads do); returns their idents and the threads Python did not
    start, counted while they are alive."""
    done, callers, errors = threading.Barrier(NUM_CALLERS + 1), [], []

    def caller(i: int) -> None:
        callers.append(threading.get_ident())
        try:
            admin.load({"lora_name": f"n{i}", "lora_path": str(root / "a")})
            admin.unload({"lora_name": f"n{i}"})
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
        done.wait()

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(NUM_CALLERS)]
    for t in threads:
        t.start()
    try:
        while len(callers) < NUM_CALLERS or done.n_waiting < NUM_CALLERS:
            time.sleep(0.01)
        assert not errors, errors
        return list(callers), _native_only_threads()
    finally:
        done.wait()
        for t in threads:
            t.join()


def test_loads_and_unloads_run_on_the_adapter_threads(tiny_engine, adapter_root):
    with tiny_engine() as engine:
        recording = RecordingEngine(engine)
        admin = AdapterAdmin(recording, AdapterPaths([str(adapter_root)]))
        callers, _ = _from_live_threads(admin, adapter_root)
        loads, unloads = recording.threads["load"], recording.threads["unload"]
        assert len(loads) == len(unloads) == NUM_CALLERS
        assert len(set(loads)) == len(set(unloads)) == 1  # one thread each, for every caller
        assert not {*loads, *unloads} & set(callers)
        assert engine.adapters() == []


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="OpenMP starts no team on one thread")
def test_handler_threads_keep_no_openmp_team(tiny_engine, adapter_root):
    with tiny_engine() as engine:
        admin = AdapterAdmin(RecordingEngine(engine, parallel_op=True),
                             AdapterPaths([str(adapter_root)]))  # fmt: skip
        _from_live_threads(admin, adapter_root)  # the adapter thread's own team starts here
        before = _native_only_threads()
        _, during = _from_live_threads(admin, adapter_root)
        assert during - before < NUM_CALLERS // 2
