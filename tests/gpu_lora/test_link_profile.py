"""The emulated link of a CPU device: each layer group's copy pays the per-transfer latency and
its bytes at the link's bandwidth, on the loader thread, pinned to the host cores it was given.

Timing is read off the throttle's own delays under a fake clock (the loader asks `sleep` for
exactly what the link would still need), never off the wall clock.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu_lora.test_cache import CONFIG, adapter
from toppings.gpu_lora.adapter_pool import AdapterPool
from toppings.gpu_lora.cache import AdapterCache
from toppings.gpu_lora.loader import LinkProfile, LoadTicket, PipelinedLoader, ThreadCopy


class FakeClock:
    """Time stands still except when slept; every sleep is recorded."""

    def __init__(self):
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def run_groups(link: LinkProfile, group_bytes: list[int]) -> FakeClock:
    clock = FakeClock()
    copier = ThreadCopy(link, clock=clock, sleep=clock.sleep)
    ticket = LoadTicket(len(group_bytes))
    copier.begin()
    moved = 0
    for layers, nbytes in enumerate(group_bytes, start=1):
        moved += nbytes
        copier.group_done(ticket, layers, moved)
        assert ticket.layers_ready() == layers
    return clock


def test_each_group_pays_latency_and_bandwidth():
    # 8 Gbit/s = 1e9 bytes/s: 2 MB take 2 ms; latency 50 us per group.
    clock = run_groups(LinkProfile(gbps=8.0, latency_us=50.0), [2_000_000, 1_000_000, 3_000_000])
    assert clock.sleeps == pytest.approx([50e-6 + 2e-3, 50e-6 + 1e-3, 50e-6 + 3e-3])


def test_latency_is_seen_on_empty_groups_and_bandwidth_without_latency():
    assert run_groups(LinkProfile(gbps=8.0, latency_us=20.0), [0, 0]).sleeps == pytest.approx(
        [20e-6, 20e-6]
    )
    assert run_groups(LinkProfile(gbps=8.0, latency_us=0.0), [4_000_000]).sleeps == pytest.approx(
        [4e-3]
    )


def test_no_link_no_delay():
    """link_gbps 0 is no emulation: copies run at memory speed, the latency is not applied."""
    assert run_groups(LinkProfile(gbps=0.0, latency_us=50.0), [1_000_000, 1_000_000]).sleeps == []


def test_time_already_spent_copying_counts_toward_the_link():
    clock = FakeClock()
    copier = ThreadCopy(LinkProfile(gbps=8.0, latency_us=100.0), clock=clock, sleep=clock.sleep)
    ticket = LoadTicket(1)
    copier.begin()
    clock.now += 0.5e-3  # the real copy took 0.5 ms of the 1.1 ms the link needs
    copier.group_done(ticket, 1, 1_000_000)
    assert clock.sleeps == pytest.approx([0.6e-3])


def _cpus_allowed(tid: int) -> set[int]:
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return _parse_list(line.split(":", 1)[1].strip())
    raise AssertionError("no Cpus_allowed_list")


def _parse_list(text: str) -> set[int]:
    cores: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_loader_thread_runs_on_its_host_cores_only():
    host = {max(os.sched_getaffinity(0))}
    main_before = os.sched_getaffinity(0)
    pool = AdapterPool(CONFIG, torch.float32, "cpu", initial_rows=8)
    loader = PipelinedLoader(pool, link_gbps=80.0, link_latency_us=10.0, cores=host)
    cache = AdapterCache(pool, loader, None)
    try:
        assert cache.acquire(adapter("x", 4)).ticket.wait(30)
        assert _cpus_allowed(loader.thread_id) == host
        assert os.sched_getaffinity(0) == main_before  # the caller's thread is not pinned
    finally:
        loader.close()
