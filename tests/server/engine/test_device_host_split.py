"""The device/host split of a CPU-only node (--device-cores / --cpu-cores).

The engine thread and the OpenMP threads it creates run on the device cores only; the CPU
workers and the adapter loader on the host cores only; the affinity masks are read back from
/proc. Overlapping lists are refused before any model loads, and the outputs of all three LoRA
modes stay those of transformers + PEFT with the split on.
"""

from __future__ import annotations

import glob
import os

import pytest

from tests.helpers import running_engine
from tests.server.engine.test_exactness import (
    assert_same_greedy,
    make_adapters,
    mixed_prompts,
    reference_greedy,
    submit_greedy,
)
from toppings.server.config import EngineConfig
from toppings.server.engine.engine import Engine
from toppings.server.model.loader import load_checkpoint
from toppings.server.requests.request import GenerationRequest, SamplingParams

ALLOWED = sorted(os.sched_getaffinity(0))
DEVICE, HOST = (ALLOWED[0],), (ALLOWED[-1],)
needs_two_cores = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two cores")
ADAPTER_BYTES = 64 * (64 + 64) * 4 * 7 * 4  # rank 64, 7 projections of ~64x64, 4 layers, f32


def cpus_allowed(status_path: str) -> set[int]:
    """The Cpus_allowed_list of a /proc/.../status file, as a set of cores."""
    with open(status_path) as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                cores: set[int] = set()
                for part in line.split(":", 1)[1].strip().split(","):
                    lo, _, hi = part.partition("-")
                    cores.update(range(int(lo), int(hi or lo) + 1))
                return cores
    raise AssertionError(f"{status_path} has no Cpus_allowed_list")


def thread_masks() -> dict[int, set[int]]:
    """Kernel thread id -> allowed cores, for every thread of this process."""
    return {int(p.split("/")[4]): cpus_allowed(p) for p in glob.glob("/proc/self/task/*/status")}


@needs_two_cores
def test_overlapping_cores_are_refused_naming_both_lists():
    with pytest.raises(ValueError, match=r"device_cores 0,1 and cpu_cores 1 overlap on 1"):
        EngineConfig(device_cores=(0, 1), cpu_cores=(1,))


def test_the_cli_refuses_overlap_in_one_line(capsys):
    from toppings.server.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "smollm2", "--device-cores", "0", "--cpu-cores", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "device_cores 0 and cpu_cores 0 overlap" in err


def test_split_is_refused_without_host_cores_or_outside_this_process():
    with pytest.raises(ValueError, match="needs cpu_cores"):
        EngineConfig(device_cores=DEVICE)
    outside = max(ALLOWED) + 1
    with pytest.raises(ValueError, match=f"cores {outside} of device_cores"):
        EngineConfig(device_cores=DEVICE, cpu_cores=(outside,))


@needs_two_cores
def test_cpu_assisted_split_needs_workers():
    """Without workers host LoRA would run on the engine thread, a device core."""
    with pytest.raises(ValueError, match="num_cpu_workers >= 1"):
        EngineConfig(lora_mode="cpu-assisted", device_cores=DEVICE, cpu_cores=HOST)
    EngineConfig(lora_mode="cpu-assisted", device_cores=DEVICE, cpu_cores=HOST, num_cpu_workers=1)


@needs_two_cores
def test_no_split_pins_nothing():
    assert EngineConfig(cpu_cores=HOST).host_cores == ()
    assert EngineConfig(device_cores=DEVICE, cpu_cores=HOST).host_cores == HOST


@needs_two_cores
def test_engine_threads_workers_and_loader_run_on_their_side(tmp_path_factory):
    from toppings.scripts.make_tiny_llama import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny_split"), num_layers=4)
    adapters = make_adapters(tmp_path_factory.mktemp("adapters_split"), model_dir)
    config = EngineConfig(
        dtype="float32", lora_mode="cpu-assisted", max_total_tokens=2048, max_batch_size=8,
        link_gbps=ADAPTER_BYTES * 8 / 0.5 / 1e9, num_cpu_workers=1,
        device_cores=DEVICE, cpu_cores=HOST,
        num_threads=2,  # a team of two on one core: its second thread must inherit the mask
    )  # fmt: skip
    engine = Engine(config, load_checkpoint(str(model_dir)))
    main_mask = os.sched_getaffinity(0)
    before = set(thread_masks())
    try:
        for name, path in adapters.items():
            engine.add_adapter(name, path)
        engine.start()
        params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        prompts = mixed_prompts(200, seed=5)
        handles = [
            engine.submit(GenerationRequest(list(p), params, engine.resolve_adapter(a)))
            for p, a in prompts
        ]
        for h in handles:
            h.result(timeout_s=120)
        assert engine.lora.host_stats.calls > 0, "no layer ran on the workers"
        masks = thread_masks()
        # The engine thread and the OpenMP team it created: every thread born after start().
        engine_side = {tid: m for tid, m in masks.items() if tid not in before}
        assert len(engine_side) >= 2, "expected the engine thread and its OpenMP thread"
        assert all(m == set(DEVICE) for m in engine_side.values()), engine_side
        assert masks[engine.lora.loader.thread_id] == set(HOST)
        pids = engine.lora.host.workers.worker_pids()
        assert pids and all(cpus_allowed(f"/proc/{pid}/status") == set(HOST) for pid in pids)
        assert os.sched_getaffinity(0) == main_mask  # the caller's thread stays unpinned
    finally:
        engine.shutdown()


@needs_two_cores
@pytest.mark.parametrize("mode", ["cached", "on-demand", "cpu-assisted"])
def test_outputs_match_peft_with_the_split_on(tmp_path_factory, mode):
    from toppings.scripts.make_tiny_llama import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path_factory.mktemp(f"tiny_split_{mode}"), num_layers=4)
    adapters = make_adapters(tmp_path_factory.mktemp(f"adapters_split_{mode}"), model_dir)
    with running_engine(
        model_dir, adapters, lora_mode=mode, max_total_tokens=4096, max_batch_size=16,
        link_gbps=0.0 if mode == "cached" else ADAPTER_BYTES * 8 / 0.5 / 1e9,
        num_cpu_workers=1 if mode == "cpu-assisted" else 0,
        device_cores=DEVICE, cpu_cores=HOST,
    ) as engine:  # fmt: skip
        prompts = mixed_prompts(200, seed=6)
        handles = submit_greedy(engine, prompts)
        ours = [h.result(timeout_s=300).new_token_ids for h in handles]
        if mode == "cpu-assisted":
            assert engine.lora.host_stats.calls > 0, "the loads were not in flight"
        if mode != "cached":
            assert engine.lora.cache.counters.loads == len(adapters)
    for (prompt, name), got in zip(prompts, ours):
        ref, margins = reference_greedy(model_dir, adapters, prompt, name)
        assert_same_greedy(got, ref, margins, f"{mode} with the split, adapter {name}")
