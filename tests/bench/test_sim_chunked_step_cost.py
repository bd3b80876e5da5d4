"""The simulator's step-time model: the engine's own StepTimeModel (server/sched/step_budget.py),
and a chunked step of d decodes and c prompt tokens costs what that model says."""

from __future__ import annotations

import pytest

from bench.sim_engine import SimSeq, StepModel, step_s
from toppings.server.sched.plan import StepPlan
from toppings.server.sched.step_budget import StepTimeModel, choose_step_budget
from toppings.server.sched.tiles import key_reads

MODEL = StepModel(ms_per_token=2.0, decode_ms=50.0, decode_ms_per_request=3.0, prefill_ms=10.0)


def test_the_step_model_is_the_engines_step_time_model():
    assert isinstance(MODEL, StepTimeModel)
    assert MODEL.decode_s(4) == pytest.approx(MODEL.decode_step_ms(4) / 1000) == 0.062
    # the step budget the simulator uses is the engine's, derived from the same numbers
    fast = StepModel(ms_per_token=0.25, decode_ms=50.0, decode_ms_per_request=3.0)
    # a 74 ms decode step beside 8: what the 150 ms target leaves, at 0.25 ms a prompt token
    assert choose_step_budget(8, 8192, model=fast).tokens == 8 + int((150 - 74) / 0.25)


def test_a_mixed_step_costs_its_decodes_step_plus_each_prompt_token():
    assert MODEL.mixed_s(4, 100) == pytest.approx((50 + 3 * 4 + 2.0 * 100) / 1000)
    assert MODEL.mixed_s(0, 100) == pytest.approx(MODEL.prefill_s(100)) == 0.21


def prefilled(prompt_len: int) -> SimSeq:
    seq = SimSeq(prompt_len, 8, 0.0, "a")
    seq.num_prefilled = prompt_len
    return seq


def plan_of(seqs, tokens) -> StepPlan:
    return StepPlan.of(dict(zip(seqs, tokens)), {})


def test_a_planned_mixed_step_is_timed_by_its_decodes_and_chunks():
    decodes = [prefilled(30) for _ in range(3)]
    chunked = [SimSeq(500, 8, 0.0, "a"), SimSeq(40, 8, 0.0, "a")]
    plan = plan_of(decodes + chunked, (1, 1, 1, 120, 40))
    assert step_s(plan, MODEL) == pytest.approx(MODEL.mixed_s(3, 160))


def test_whole_prompt_and_decode_steps_keep_their_own_costs():
    seqs = (SimSeq(70, 8, 0.0, "a"), SimSeq(30, 8, 0.0, "a"))
    assert step_s(plan_of(seqs, (70, 30)), MODEL, chunked=False) == pytest.approx(
        MODEL.prefill_s(100)
    )
    assert step_s(plan_of([prefilled(9) for _ in range(5)], (1,) * 5), MODEL) == 0.065


def test_a_late_chunk_costs_the_past_it_attends_to():
    slow_past = StepModel(ms_per_token=2.0, decode_ms=50.0, decode_ms_per_request=3.0,
                          ms_per_token_past=0.01)  # fmt: skip
    decode, late = prefilled(30), SimSeq(2000, 8, 0.0, "a")
    late.num_prefilled = 1000
    plan = plan_of([decode, late], (1, 100))
    # the keys the blocked kernel reads: 4 tiles of 32, the last one padded (server.sched.tiles)
    past_ms = 0.01 * 128 * (1000 + 127 / 2)
    assert key_reads(100, 1000) == 128 * (1000 + 127 / 2)
    assert step_s(plan, slow_past) == pytest.approx(slow_past.mixed_s(1, 100) + past_ms / 1000)


def test_the_engines_model_runs_the_simulator_as_it_stands():
    engine = StepTimeModel(ms_per_token=0.3, decode_ms=20.0, decode_ms_per_request=0.5,
                           mixed_fixed_ms=4.0, ms_per_token_past=0.001)  # fmt: skip
    sim = StepModel.of_engine(engine, "a real run's engine")
    assert sim.source == "a real run's engine"
    assert sim.mixed_s(8, 50) == pytest.approx(engine.mixed_step_ms(8, 50) / 1000)
    # a step of prompt tokens alone costs what the engine's model says of it
    assert sim.mixed_s(0, 50) == pytest.approx(engine.mixed_step_ms(0, 50) / 1000)
