"""The step-time model follows the steps the engine really runs (server/sched/step_refit.py):
every window of steps of a kind moves that kind's fixed cost (and the cost of a prompt token's
past) halfway to what the window shows, and the engine resizes its chunked-prefill steps when
that moves the budget."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from toppings.server.config import EngineConfig
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.runtime import build_engine
from toppings.server.sched.admission import GateLimits
from toppings.server.sched.scheduler import StepPlan
from toppings.server.sched.step_budget import StepTimeModel
from toppings.server.sched.step_refit import WINDOW, StepRefit, StepShape, shape_of

MODEL = StepTimeModel(ms_per_token=0.3, decode_ms=10.0, decode_ms_per_request=0.5)


def test_decode_steps_move_the_decode_cost_halfway_to_the_median_gap():
    refit = StepRefit(MODEL, window=9)
    for i in range(8):
        assert refit.observe(StepShape(4 * i), MODEL.decode_step_ms(4 * i) + 4.0) is None
    # the odd slow step (a page fault) does not move the median
    model = refit.observe(StepShape(2), MODEL.decode_step_ms(2) + 500.0)
    assert model.decode_ms == pytest.approx(12.0)
    assert model.mixed_fixed_ms == 0.0 and model.ms_per_token == MODEL.ms_per_token
    assert refit.model is model and refit.num_refits == 1
    for _ in range(9):  # the same steps again: halfway from there
        last = refit.observe(StepShape(4), MODEL.decode_step_ms(4) + 4.0)
    assert last.decode_ms == pytest.approx(13.0)


def test_steps_with_prompt_tokens_move_only_their_own_fixed_cost():
    refit = StepRefit(MODEL, window=4)
    for _ in range(6):
        for i in range(4):
            model = refit.observe(StepShape(8, 40 + i), MODEL.mixed_step_ms(8, 40 + i) - 3.0)
    assert model.mixed_fixed_ms == pytest.approx(-3.0, abs=0.1)
    assert model.decode_ms == MODEL.decode_ms and model.ms_per_token_past == 0.0


def test_steps_of_prompt_tokens_without_decodes_are_left_out():
    """Those steps are large and cheaper per token than the start-up slope: fitted on, they
    would pull the fixed cost of the steps with decodes below what those show."""
    refit = StepRefit(MODEL, window=4)
    for _ in range(3):
        assert refit.observe(StepShape(0, 600), MODEL.mixed_step_ms(0, 600) - 40.0) is None
    for i in range(4):
        model = refit.observe(StepShape(8, 40 + i), MODEL.mixed_step_ms(8, 40 + i) + 2.0)
    assert model.mixed_fixed_ms == pytest.approx(1.0)  # halfway to the steps with decodes' +2


def true_step_ms(shape: StepShape) -> float:
    """Steps that cost 6 ms more than MODEL_PAST says, and 4x its cost of the past."""
    return (
        MODEL_PAST.mixed_step_ms(shape.num_decodes, shape.prompt_tokens)
        + 6.0
        + 0.004 * (shape.past_work)
    )


MODEL_PAST = StepTimeModel(ms_per_token=0.3, decode_ms=10.0, decode_ms_per_request=0.5,
                           ms_per_token_past=0.001)  # fmt: skip


def test_the_cost_of_the_past_is_fitted_where_the_pasts_differ():
    refit = StepRefit(MODEL_PAST, window=16)
    for _ in range(12):
        for i in range(16):
            shape = StepShape(32, 20 - i, (20 - i) * 300.0 * i)  # later chunks: smaller, later
            ms = true_step_ms(shape) + (50.0 if i == 7 else 0.0)  # one slow step a window
            model = refit.observe(shape, ms)
    assert model.ms_per_token_past == pytest.approx(0.004, rel=0.02)
    assert model.mixed_fixed_ms == pytest.approx(6.0, abs=0.2)
    assert model.past_weight() == pytest.approx(0.004 / 0.3, rel=0.02)


def test_a_window_of_like_pasts_moves_the_fixed_cost_only():
    refit = StepRefit(MODEL_PAST, window=8)
    for i in range(8):
        shape = StepShape(32, 16, 16 * (1000.0 + i))  # 0.001 x 7 x 16 ms apart: too close
        model = refit.observe(shape, true_step_ms(shape))
    assert model.ms_per_token_past == MODEL_PAST.ms_per_token_past
    assert model.mixed_fixed_ms > 0.0


def test_a_stalled_window_corrects_nothing():
    refit = StepRefit(MODEL, window=2)
    refit.observe(StepShape(1), 5_000.0)
    assert refit.observe(StepShape(1), 5_000.0) is None
    assert refit.model == MODEL and refit.num_refits == 0


@dataclass(eq=False)
class _Seq:
    prompt_len: int
    num_prefilled: int

    @property
    def is_prefilled(self) -> bool:
        return self.num_prefilled >= self.prompt_len


def test_a_steps_shape_counts_decodes_prompt_tokens_and_their_past():
    decode, early, late = _Seq(10, 10), _Seq(50, 0), _Seq(500, 400)
    plan = StepPlan((decode, early, late), (1, 20, 20), (True, False, False), (10, 0, 400), True)
    assert shape_of(plan) == StepShape(1, 40, 20 * 9.5 + 20 * 409.5)
    assert shape_of(StepPlan((decode,), (1,), (True,), (10,), False)) == StepShape(1)
    # what the gate charges a chunk is the same past: n + past_weight x its past work
    limits = GateLimits(8, 512, 100, past_weight=0.01)
    assert limits.chunk_cost(20, 400) == math.ceil(20 + 0.01 * 20 * 409.5)


def generate(engine, prompts):
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    handles = engine.submit_all([GenerationRequest(p, params) for p in prompts])
    return [h.result(timeout_s=120).new_token_ids for h in handles]


PROMPTS = [[5 + i, 17, 33 + 2 * i, 9] * (6 + 3 * i) for i in range(6)]


def test_the_engine_resizes_its_steps_from_the_steps_it_runs(tiny_model_dir):
    # A model far slower than any tiny-model step: a 500 ms decode step gives a budget at its
    # ceiling; the real steps (milliseconds) bring it down to the floor.
    slow = StepTimeModel(ms_per_token=1.0, decode_ms=500.0, decode_ms_per_request=0.0)
    config = EngineConfig(dtype="float32", chunked_prefill=True, max_batch_size=8,
                          max_prefill_tokens=256)  # fmt: skip
    engine = build_engine(str(tiny_model_dir), config, step_model=slow)
    try:
        first = engine.step_budget.tokens
        assert first == 256
        outputs = [generate(engine, PROMPTS) for _ in range(-(-2 * WINDOW // 40))]
        assert engine.step_model.decode_ms < slow.decode_ms
        assert engine.step_budget.tokens < first
        assert engine.scheduler.limits.max_step_tokens == engine.step_budget.tokens
        assert all(out == outputs[0] for out in outputs)  # a smaller step changes no token
    finally:
        engine.shutdown()
    given = EngineConfig(dtype="float32", chunked_prefill=True, max_batch_size=8,
                         max_prefill_tokens=256, max_num_batched_tokens=64)  # fmt: skip
    engine = build_engine(str(tiny_model_dir), given, step_model=slow)
    try:
        generate(engine, PROMPTS)
        generate(engine, PROMPTS)
        assert engine.step_budget.tokens == 64 == engine.scheduler.limits.max_step_tokens
    finally:
        engine.shutdown()
