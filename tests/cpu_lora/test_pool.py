"""CpuLoraPool against the float32 reference, and its recovery from dead or hung workers."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time

import pytest
import torch
from cpu_lora_helpers import QKV, reference, tiny_config

from tests.helpers import adapter_id
from toppings.cpu_lora import CpuLoraPool, HostRepository

# Mixed ranks 4/8/16, a segment with no adapter (5-9), tokens in no segment (9-12, 40-45),
# and an adapter without LoRA on k_proj (c16) or without LoRA on layer 1 ("late").
SEGMENTS = [
    (adapter_id("a4"), 0, 5),
    (None, 5, 9),
    (adapter_id("b8"), 12, 25),
    (adapter_id("c16"), 25, 33),
    (adapter_id("late"), 33, 40),
]
NUM_TOKENS = 45


def _check(pool, adapters, layer=1, modules=QKV, seed=0):
    x = torch.randn(NUM_TOKENS, 128, generator=torch.Generator().manual_seed(seed))
    got = pool.run(layer, x, SEGMENTS, modules)
    want = reference(adapters, layer, x, SEGMENTS, modules)
    assert set(got) == set(modules)
    for module in modules:
        torch.testing.assert_close(got[module], want[module], rtol=1e-5, atol=1e-5)
    return got


@pytest.mark.parametrize("workers_used", [1, 2])
@pytest.mark.parametrize("layer", [1, 2])
def test_matches_reference(pool2, adapters, workers_used, layer):
    pool2.tokens_per_core = 1000 if workers_used == 1 else 1
    got = _check(pool2, adapters, layer=layer)
    assert len(pool2.last_call.worker_compute_ns) == workers_used
    assert pool2.last_call.fallbacks == 0
    assert got["q_proj"][9:12].abs().sum() == 0 and got["q_proj"][40:].abs().sum() == 0
    assert got["k_proj"][25:33].abs().sum() == 0  # c16 has no k_proj
    assert (got["k_proj"][33:40].abs().sum() == 0) == (layer == 1)  # "late": layer 2 only


def test_rows_without_adapter_are_zero_after_a_full_call(pool2, adapters):
    pool2.tokens_per_core = 4
    dirty = [(adapter_id("b8"), 0, NUM_TOKENS)]  # every row
    pool2.run(1, torch.randn(NUM_TOKENS, 128), dirty, QKV)
    got = _check(pool2, adapters, seed=5)
    assert not got["v_proj"][5:12].any() and not got["v_proj"][40:].any()


def test_zero_copy_path(pool2, adapters):
    pool2.tokens_per_core = 8
    x = torch.randn(NUM_TOKENS, 128)
    staged = pool2.input_buffer(NUM_TOKENS, 128)
    staged.copy_(x)
    got = pool2.run(1, staged, SEGMENTS, QKV, copy=False)
    want = reference(adapters, 1, x, SEGMENTS, QKV)
    for module in QKV:
        torch.testing.assert_close(got[module], want[module], rtol=1e-5, atol=1e-5)


def test_only_the_segments_span_of_x_is_copied(pool2, adapters):
    """A decode batch with one request loading ships that request's rows, not the batch."""
    pool2.tokens_per_core = 4
    staged = pool2.input_buffer(NUM_TOKENS, 128)
    staged.fill_(7.0)
    x = torch.randn(NUM_TOKENS, 128)
    segments = [
        (None, 0, 12),
        (adapter_id("b8"), 12, 25),
        (adapter_id("c16"), 25, 33),
        (None, 33, NUM_TOKENS),
    ]
    got = pool2.run(1, x, segments, QKV)
    want = reference(adapters, 1, x, segments, QKV)
    for module in QKV:
        torch.testing.assert_close(got[module], want[module], rtol=1e-5, atol=1e-5)
    assert (staged[:12] == 7.0).all() and (staged[33:] == 7.0).all()
    torch.testing.assert_close(staged[12:33], x[12:33], rtol=0, atol=0)


def test_mlp_and_o_proj_groups(pool2, adapters):
    pool2.tokens_per_core = 8
    _check(pool2, adapters, modules=("gate_proj", "up_proj"))
    x = torch.randn(NUM_TOKENS, 256)
    got = pool2.run(0, x, SEGMENTS, ("down_proj",))["down_proj"]
    want = reference(adapters, 0, x, SEGMENTS, ("down_proj",))["down_proj"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_no_adapter_tokens_give_zeros_and_errors_are_clear(pool2):
    got = pool2.run(0, torch.randn(6, 128), [(None, 0, 6)], QKV)
    assert all(y.shape[0] == 6 and not y.any() for y in got.values())
    with pytest.raises(KeyError, match=f"adapter id {adapter_id('nope')} is not"):
        pool2.run(0, torch.randn(6, 128), [(adapter_id("nope"), 0, 6)], QKV)
    with pytest.raises(ValueError, match="overlaps"):
        pool2.run(0, torch.randn(6, 128), [(adapter_id("a4"), 0, 4), (adapter_id("b8"), 3, 6)], QKV)
    with pytest.raises(ValueError, match="different inputs"):
        pool2.run(0, torch.randn(6, 128), [(adapter_id("a4"), 0, 6)], ("q_proj", "down_proj"))


def _kill(pid: int, sig=signal.SIGKILL) -> None:
    os.kill(pid, sig)


def test_worker_killed_between_calls_is_replaced(pool2, adapters):
    pool2.tokens_per_core = 1
    victim = pool2.worker_pids()[1]
    _kill(victim)
    _check(pool2, adapters, seed=1)  # correct although worker 1 is dead
    pool2.wait_ready(120)
    assert victim not in pool2.worker_pids()
    _check(pool2, adapters, seed=2)
    assert len(pool2.last_call.worker_compute_ns) == 2  # the replacement takes work again


def test_worker_killed_during_a_call(pool2, adapters):
    pool2.tokens_per_core = 1
    victim = pool2.worker_pids()[0]
    os.kill(victim, signal.SIGSTOP)  # it holds its job without answering ...
    killer = threading.Timer(0.3, _kill, (victim,))  # ... until it dies mid-call
    killer.start()
    _check(pool2, adapters, seed=3)
    killer.join()
    assert pool2.last_call.fallbacks == 1
    pool2.wait_ready(120)
    assert victim not in pool2.worker_pids()


def test_hung_worker_times_out(pool2, adapters):
    pool2.tokens_per_core, pool2.timeout_s = 1, 1.0
    victim = pool2.worker_pids()[1]
    os.kill(victim, signal.SIGSTOP)
    try:
        _check(pool2, adapters, seed=4)
    finally:
        pool2.timeout_s = 30.0
    assert pool2.last_call.fallbacks >= 1  # the other worker too, were it slower than 1 s
    with pytest.raises(ProcessLookupError):
        os.kill(victim, 0)  # killed and reaped
    pool2.wait_ready(120)


def test_a_worker_that_keeps_dying_is_restarted_after_a_backoff(pool2, adapters):
    """A replacement that dies soon after its start waits before it is started again (a worker
    that cannot run was a new python + torch process every call): the calls meanwhile compute
    its slices here; reading the workers' state (what /stats and /metrics do) starts it once
    the delay has passed, with no call needed (an idle server reported it down)."""
    pool2.tokens_per_core = 1
    _kill(pool2.worker_pids()[1])
    _check(pool2, adapters, seed=5)
    pool2.wait_ready(120)  # replaced (at once, or after a delay if it was young itself)
    young = pool2.worker_pids()[1]
    _kill(young)
    _check(pool2, adapters, seed=6)  # a replacement's early exit: its restart waits
    assert pool2.worker_pids()[1] == young and pool2.last_call.fallbacks >= 1
    deadline = time.monotonic() + 120
    while not all(w["alive"] for w in pool2.workers_info()):
        assert time.monotonic() < deadline, pool2.workers_info()
        time.sleep(0.1)
    assert pool2.worker_pids()[1] != young
    pool2.wait_ready(120)


def test_bfloat16_pool(adapters):
    repo = HostRepository.create(tiny_config(), 1 << 20, dtype=torch.bfloat16)
    try:
        for adapter in adapters:
            repo.add(adapter)
        with CpuLoraPool(repo, tiny_config(), 1, max_tokens=64, tokens_per_core=8) as pool:
            x = torch.randn(NUM_TOKENS, 128)
            got = pool.run(2, x, SEGMENTS, QKV)
            want = reference(adapters, 2, x, SEGMENTS, QKV)
            for module in QKV:
                assert got[module].dtype == torch.float32  # x's dtype
                torch.testing.assert_close(got[module], want[module], rtol=2e-2, atol=5e-2)
    finally:
        repo.close()


def test_one_worker_pool_and_close(repo, adapters):
    pool = CpuLoraPool(repo, tiny_config(), num_workers=1, max_tokens=64, modules=QKV)
    assert pool.profile_result is not None and pool.tokens_per_core >= 1
    pids, names = pool.worker_pids(), pool.shm_names()
    _check(pool, adapters)
    assert len(pool.last_call.worker_compute_ns) == 1
    pool.close()
    left = set(os.listdir("/dev/shm"))
    assert not any(n.lstrip("/") in left or "sem." + n.lstrip("/") in left for n in names)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(0, torch.randn(2, 128), [(adapter_id("a4"), 0, 2)], QKV)


def test_spinning_pool_matches_reference_and_survives_a_kill(repo, adapters):
    """spin_us > 0: back-to-back calls (taken while spinning) and a killed worker stay correct."""
    with CpuLoraPool(
        repo, tiny_config(), 2, max_tokens=64, tokens_per_core=1, spin_us=5000
    ) as pool:
        for seed in range(20):
            _check(pool, adapters, layer=1 + seed % 2, seed=seed)
            assert pool.last_call.fallbacks == 0
        _kill(pool.worker_pids()[0])
        _check(pool, adapters, seed=21)
        pool.wait_ready(120)
        for seed in range(22, 30):
            _check(pool, adapters, seed=seed)
        assert len(pool.last_call.worker_compute_ns) == 2


def test_spin_us_must_not_be_negative(repo):
    with pytest.raises(ValueError, match="spin_us"):
        CpuLoraPool(repo, tiny_config(), 1, max_tokens=64, tokens_per_core=1, spin_us=-1)


def test_workers_wait_for_x_to_land(pool2, adapters, monkeypatch):
    """As with a device copy still in flight: the call is posted while the arena holds garbage,
    and x plus its mark land 0.3 s later; every worker must compute on the real x."""
    import toppings.cpu_lora.pool as pool_module

    real_copy, real_mark = pool_module.copy_serial, pool2.io.set_x_seq
    pending = []

    arena_x = pool2.input_buffer(NUM_TOKENS, 128).data_ptr()

    def copy_later(dst, src):
        if dst.data_ptr() != arena_x:  # the outputs' copy
            return real_copy(dst, src)
        dst.fill_(float("nan"))  # what the workers would read if they did not wait
        pending.append((dst, src.clone()))

    def mark_later(seq):
        def land():
            dst, src = pending.pop()
            real_copy(dst, src)
            real_mark(seq)

        threading.Timer(0.3, land).start()

    monkeypatch.setattr(pool_module, "copy_serial", copy_later)
    monkeypatch.setattr(pool2.io, "set_x_seq", mark_later)
    pool2.tokens_per_core = 1
    _check(pool2, adapters, seed=7)  # NaN anywhere would fail the comparison
    assert pool2.last_call.fallbacks == 0 and len(pool2.last_call.worker_compute_ns) == 2


def test_x_mark_round_trip_and_timeout(pool2):
    from toppings.cpu_lora.compute import wait_for_x
    from toppings.cpu_lora.protocol import OP_RUN, Job

    io = pool2.io
    io.set_x_seq(41)
    assert io.x_seq() == 41 and io.x_seq_tensor().item() == 41  # the same word
    job = Job(5, OP_RUN, 1, 7, 3, 0, 3, ((0, 0, 3),), x_seq=42)
    io.write_job(0, job)
    assert io.read_job(0) == job
    with pytest.raises(RuntimeError, match="did not arrive"):
        wait_for_x(io, job, timeout_s=0.05)
    io.x_seq_tensor().fill_(42)  # what a device copy of the mark does
    wait_for_x(io, job, timeout_s=0.05)


def test_workers_started_under_numactl_are_pinned(repo, adapters):
    core = sorted(os.sched_getaffinity(0))[-1]
    probe = ["numactl", f"--physcpubind={core}", "--localalloc", "true"]
    if shutil.which("numactl") is None or subprocess.run(probe, capture_output=True).returncode:
        pytest.skip("numactl is not installed or may not bind here")
    with CpuLoraPool(
        repo, tiny_config(), 1, [core], max_tokens=64, tokens_per_core=8, use_numactl=True
    ) as pool:
        assert os.sched_getaffinity(pool.worker_pids()[0]) == {core}
        _check(pool, adapters, seed=9)
        assert pool.last_call.fallbacks == 0


def test_the_pool_counts_every_core_where_the_os_cannot_say_which_it_may_use(monkeypatch):
    from toppings.cpu_lora.workers import allowed_cores

    if hasattr(os, "sched_getaffinity"):
        assert allowed_cores() == sorted(os.sched_getaffinity(0))
        monkeypatch.delattr(os, "sched_getaffinity")
    assert allowed_cores() == list(range(os.cpu_count() or 1))
