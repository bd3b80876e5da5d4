"""The step-time model follows the steps the engine really runs (server/sched/step_refit.py):
each kind's fixed cost moves by the median gap over a window, and the engine resizes its
chunked-prefill steps when that moves the budget."""

from __future__ import annotations

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


def test_decode_steps_move_the_decode_cost_by_the_median_gap():
    refit = StepRefit(MODEL, window=9)
    for i in range(8):
        shape = StepShape(num_decodes=4 * i, prompt_cost=0)
        assert refit.observe(shape, MODEL.mixed_step_ms(4 * i, 0) + 4.0) is None
    # the odd slow step (a page fault) does not move the median
    model = refit.observe(StepShape(2, 0), MODEL.mixed_step_ms(2, 0) + 500.0)
    assert model.decode_ms == pytest.approx(14.0)
    assert model.mixed_fixed_ms == 0.0 and model.ms_per_token == MODEL.ms_per_token
    assert refit.model is model and refit.num_refits == 1


def test_steps_with_prompt_tokens_move_only_their_own_fixed_cost():
    refit = StepRefit(MODEL, window=4)
    models = [refit.observe(StepShape(8, 40 + i), MODEL.mixed_step_ms(8, 40 + i) - 3.0)
              for i in range(4)]  # fmt: skip
    assert models[:3] == [None] * 3
    assert models[3].mixed_fixed_ms == pytest.approx(-3.0)
    assert models[3].decode_ms == MODEL.decode_ms
    # a window later, measured against the corrected model: no further move
    for _ in range(4):
        last = refit.observe(StepShape(8, 40), MODEL.mixed_step_ms(8, 40) - 3.0)
    assert last.mixed_fixed_ms == pytest.approx(-3.0)


def test_a_stalled_window_corrects_nothing():
    refit = StepRefit(MODEL, window=2)
    refit.observe(StepShape(1, 0), 5_000.0)
    assert refit.observe(StepShape(1, 0), 5_000.0) is None
    assert refit.model == MODEL and refit.num_refits == 0


@dataclass(eq=False)
class _Seq:
    prompt_len: int
    num_prefilled: int

    @property
    def is_prefilled(self) -> bool:
        return self.num_prefilled >= self.prompt_len


def test_a_steps_shape_counts_decodes_and_weighs_late_chunks():
    limits = GateLimits(8, 512, 100, past_weight=0.01)
    decode, early, late = _Seq(10, 10), _Seq(50, 0), _Seq(500, 400)
    plan = StepPlan((decode, early, late), True, (1, 20, 20), (True, False, False))
    shape = shape_of(plan, limits)
    assert shape.num_decodes == 1
    assert shape.prompt_cost == limits.chunk_cost(20, 0) + limits.chunk_cost(20, 400)
    assert shape_of(StepPlan((decode,), False), limits) == StepShape(1, 0)


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
