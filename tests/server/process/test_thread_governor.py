"""The thread governor (server/process/thread_governor.py) keeps the count whose decode steps are
faster, and follows the machine when that changes: a neighbour taking a core, then leaving.
Step times are synthetic (a model of each count's cost, with noise), never measured here."""

from __future__ import annotations

import random
import time

import pytest
import torch

from tests.helpers import running_engine
from toppings.server.config import EngineConfig
from toppings.server.process.cores_watch import CoresWatch
from toppings.server.process.thread_governor import ThreadGovernor
from toppings.server.requests.request import GenerationRequest, SamplingParams

# seconds of a batch-4 decode step by thread count: a quiet machine, and beside a neighbour
# that holds one of the two cores (the team's barriers then wait for a descheduled thread)
QUIET = {2: 0.010, 1: 0.018}
BUSY = {2: 0.060, 1: 0.013}


class Machine:
    """The other processes' CPU time, as the governor reads it: while a neighbour runs, most of
    a core beside all the threads and all of it beside fewer, else a client reading the
    stream's tokens (a few hundredths of a core, now and then a tenth); plus `spare` cores'
    worth (CPU workers on cores the engine leaves them). The clock is the steps' time."""

    def __init__(self, spare: float = 0.0) -> None:
        self.busy, self.clock, self.cpu, self.rng = False, 0.0, 0.0, random.Random(9)
        self.spare, self.threads = spare, 2

    def step(self, seconds: float) -> None:
        self.clock += seconds
        share = (0.7 if self.threads == 2 else 1.0) if self.busy else 0.03
        if not self.busy and self.rng.random() < 0.1:
            share = 0.1
        self.cpu += seconds * (share + self.spare)

    def others(self) -> float:
        return self.cpu

    def time(self) -> float:
        return self.clock


def governed(machine: Machine | None = None, cores: int = 2, **kwargs) -> ThreadGovernor:
    """A governor on two threads of `cores`; reading `machine`'s CPU time (None: it cannot)."""
    others = machine.others if machine else lambda: None
    clock = machine.time if machine else time.monotonic
    watch = CoresWatch(frozenset(range(cores)), 2, others=others, clock=clock)
    return ThreadGovernor(2, watch=watch, **kwargs)


def run(governor: ThreadGovernor, cost: dict[int, float], steps: int, rng, batch=4,
        machine: Machine | None = None) -> list[int]:  # fmt: skip
    """Feed `steps` decode steps whose time is cost[threads] with 20% noise and a 5x outlier
    now and then; returns the thread count each ran on."""
    if machine is not None:
        machine.busy = cost is BUSY or cost is STALLED
    counts = []
    for _ in range(steps):
        counts.append(governor.threads)
        seconds = cost[governor.threads] * rng.lognormvariate(0.0, 0.2)
        if rng.random() < 0.02:
            seconds *= 5.0
        if machine is not None:
            machine.threads = governor.threads
            machine.step(seconds)
        governor.observe(batch, seconds)
    return counts


def test_it_follows_a_neighbour_arriving_and_leaving():
    """Where it cannot read the kernel's tasks, its periodic probe brings the threads back."""
    rng, governor = random.Random(0), governed()
    quiet = run(governor, QUIET, 1000, rng)
    assert governor.threads == 2 and governor.switches == 0
    assert quiet.count(1) <= 3 * 8  # the probes: a few dozen steps of 1,000
    busy = run(governor, BUSY, 400, rng)
    assert governor.threads == 1
    assert busy.index(1) <= 32 and busy[40:].count(2) <= 1  # moved within a few dozen steps
    back = run(governor, QUIET, 800, rng)
    assert governor.threads == 2 and governor.switches == 2
    assert back.index(2) <= 800 and back[-200:].count(1) <= 8


def test_free_cores_bring_the_threads_back_at_once():
    """Where it reads the other processes' CPU time, the cores' freeing is seen within its
    window (a quarter of a second: some 20 steps here), and a neighbour's core is never taken
    for a free one."""
    rng, machine = random.Random(4), Machine()
    governor = governed(machine)
    run(governor, QUIET, 500, rng, machine=machine)
    busy = run(governor, BUSY, 3000, rng, machine=machine)
    probes = sum(1 for a, b in zip(busy[40:], busy[41:]) if (a, b) == (1, 2))
    assert probes <= 5  # the periodic ones (3) and noise's; the cores read free: one in 0.25 s
    back = run(governor, QUIET, 200, rng, machine=machine)
    assert back.index(2) <= 24 and governor.threads == 2


# a neighbour's barrier waits as toppings-serve's showed them on a 2-core EPYC (bench_neighbour)
STALLED = {2: 0.700, 1: 0.014}


def test_a_crowded_team_moves_after_two_slow_steps():
    """Beside a neighbour, steps of all the threads may take 700 ms: waiting for the median of
    8 steps to slow took 4 of them; the neighbour's CPU time beside two slow steps is enough."""
    rng, machine = random.Random(7), Machine()
    governor = governed(machine)
    run(governor, QUIET, 500, rng, machine=machine)
    busy = run(governor, STALLED, 200, rng, machine=machine)
    assert busy.index(1) <= 2 and busy[10:].count(2) <= 1
    blind, counts = governed(), []  # where it cannot read the CPU time, without noise
    steady(blind, QUIET, 500)
    for _ in range(10):
        counts.append(blind.threads)
        blind.observe(4, STALLED[blind.threads])
    assert counts.index(1) == 4  # the median of 8 steps, 4 of them slow


def test_a_crowded_team_that_is_not_slowed_keeps_its_threads():
    """Others taking half a core and more (a load generator on a larger machine) without
    slowing the steps, or slowing them by noise's 1.6x, are no reason to leave all threads."""
    rng, machine = random.Random(10), Machine()
    machine.busy = True  # 0.7 of a core all along
    governor = governed(machine)
    for _ in range(3000):
        seconds = QUIET[governor.threads] * (1.6 if rng.random() < 0.2 else 1.0)
        machine.threads = governor.threads
        machine.step(seconds)
        governor.observe(4, seconds)
    assert governor.chosen == 2 and governor.switches == 0


def test_cores_left_to_the_cpu_workers_are_theirs():
    """Two engine threads of four cores: the CPU workers' two cores of work on the others is no
    neighbour, so the cores read free as soon as the neighbour leaves."""
    rng, machine = random.Random(8), Machine(spare=2.0)
    governor = governed(machine, cores=4)
    run(governor, QUIET, 500, rng, machine=machine)
    run(governor, BUSY, 1000, rng, machine=machine)
    assert governor.threads == 1
    back = run(governor, QUIET, 200, rng, machine=machine)
    assert back.index(2) <= 24 and governor.threads == 2


def test_the_processes_cpu_time_is_read_once_a_window():
    """Reading it costs some 50 us on a 2-core EPYC: once a quarter of a second, not a step."""
    rng, machine, reads = random.Random(6), Machine(), []
    watch = CoresWatch(frozenset({0, 1}), 2, others=lambda: reads.append(1) or machine.others(),
                       clock=machine.time)  # fmt: skip
    governor = ThreadGovernor(2, watch=watch)
    run(governor, BUSY, 2000, rng, machine=machine)
    assert governor.chosen == 1
    assert 0 < len(reads) <= machine.clock / 0.25 + 2


def test_a_probe_far_slower_stops_after_one_step():
    """Beside a neighbour, the periodic probe of all the threads costs one slow step."""
    rng, governor = random.Random(5), governed()
    run(governor, BUSY, 500, rng)  # a busy start-up: its first periodic probe moves it
    assert governor.threads == 1
    busy = run(governor, BUSY, 3000, rng)
    probes = sum(1 for a, b in zip([1] + busy, busy) if (a, b) == (1, 2))
    assert probes >= 2 and busy.count(2) == probes


def test_a_neighbour_at_start_up_is_left_behind():
    """A disturbed start: the first steps run beside the neighbour, at every core."""
    rng, governor = random.Random(1), governed(probe_every=200)
    counts = run(governor, BUSY, 300, rng)
    assert counts[-100:].count(1) >= 90
    run(governor, QUIET, 400, rng)
    assert governor.threads == 2


def test_only_steps_of_the_same_batch_size_are_compared():
    """A probe whose steps are of another batch size than the chosen count's decides nothing."""
    governor = governed(probe_every=8, probe_steps=4)
    for _ in range(8):
        governor.observe(1, 0.010)
    assert governor.threads == 1  # a probe
    for _ in range(4):
        governor.observe(32, 0.001)  # far faster, but 32 rows are not 1 row
    assert governor.threads == 2 and governor.switches == 0


def test_one_thread_has_nothing_to_choose():
    governor = ThreadGovernor(1, watch=CoresWatch(frozenset({0, 1}), 1, others=lambda: None))
    run(governor, {1: 0.01}, 1000, random.Random(2))
    assert governor.threads == 1 and governor.switches == 0


def test_cpu_only():
    assert EngineConfig(device="cpu").use_thread_governor
    assert not EngineConfig(device="cpu", adapt_threads=False).use_thread_governor
    with pytest.raises(ValueError, match="--adapt-threads on needs --device cpu"):
        EngineConfig(device="cuda", adapt_threads=True)


def test_the_engine_runs_its_steps_on_the_governors_count(tiny_model_dir):
    """Decode steps (only they) are told to the governor, and each step runs on the count it
    says: a governor that probes every 4 steps makes some decode steps run on one thread, and
    the steps with prompt tokens on the chosen count, probe or not."""
    with running_engine(tiny_model_dir, num_threads=2) as engine:
        governor = engine.governor = governed(probe_every=4, probe_steps=2)
        ran, told = [], []
        run_plan, observe = engine.runner.run, governor.observe

        def counted_run(plan):
            wanted = governor.chosen if plan.is_prefill else governor.threads
            ran.append((torch.get_num_threads(), wanted, plan.is_prefill))
            return run_plan(plan)

        def counted_observe(batch, seconds):
            told.append(batch)
            observe(batch, seconds)

        engine.runner.run, governor.observe = counted_run, counted_observe
        params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
        engine.submit(GenerationRequest([5, 6, 7, 8], params)).result(timeout_s=120)
    assert all(now == wanted for now, wanted, _ in ran)
    assert {now for now, _, prefill in ran if not prefill} == {1, 2}
    assert len(told) == sum(not prefill for _, _, prefill in ran)


def test_a_steady_machine_is_probed_less_and_less():
    """Each probe that changes nothing doubles the interval: 6,000 quiet steps hold 4 probes
    (at 400, 1,200, 2,800 and 6,000 steps), not 15."""
    counts = run(governed(), QUIET, 6000, random.Random(3))
    assert counts.count(1) <= 4 * 8


def test_a_step_with_prompt_tokens_runs_on_the_chosen_count_during_a_probe():
    """A probe tries its count on decode steps only: a prompt that comes in meanwhile runs on
    the count decided on (on half the threads a long prompt took twice its time)."""
    governor, before = governed(probe_every=4, probe_steps=4), torch.get_num_threads()
    try:
        run(governor, QUIET, 4, random.Random(5))  # the probe starts after the 4th step
        assert (governor.threads, governor.chosen) == (1, 2)
        governor.apply(prompt_tokens=True)
        assert torch.get_num_threads() == 2
        governor.apply()
        assert torch.get_num_threads() == 1
        governor.apply(prompt_tokens=True)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def steady(governor: ThreadGovernor, cost: dict[int, float], steps: int) -> None:
    """Feed `steps` decode steps of batch 4 whose time is exactly cost[threads]."""
    for _ in range(steps):
        governor.observe(4, cost[governor.threads])


def test_fewer_threads_only_when_clearly_faster():
    """One thread at 0.75x the time of two (what noise and a benchmark's own client gave) is no
    reason to leave all the threads, on which the prompts, never measured by a probe, run far
    faster; a neighbour's barrier waits (BUSY: 0.22x) are."""
    governor = governed()
    steady(governor, {2: 0.010, 1: 0.0075}, 3000)
    assert (governor.chosen, governor.switches) == (2, 0)
    steady(governor, BUSY, 3000)
    assert governor.chosen == 1


def test_all_the_threads_again_when_no_slower():
    """From fewer threads, a probe that finds all of them as fast goes back to them (decode
    steps of a few requests may not tell the counts apart; prompts can)."""
    governor = governed()
    steady(governor, BUSY, 500)
    assert governor.chosen == 1
    steady(governor, {2: 0.013, 1: 0.013}, 1000)
    assert (governor.chosen, governor.switches) == (2, 2)
