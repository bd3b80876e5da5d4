"""A fault of the chunked-prefill budget's refit (server/sched/step_budget_keeper.py) after a
step does not kill the engine: the step's requests got their tokens, and the loop goes on with
the budget it had (seen on a loaded machine: a refit gave a NaN cost per token, `int(NaN)`
raised in the engine thread, and every stream of the server ended with 503)."""

from __future__ import annotations

from toppings.server.config import EngineConfig
from toppings.server.engine.engine import Engine
from toppings.server.model.loader import load_checkpoint
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.sched.step_budget import StepTimeModel
from toppings.server.sched.step_refit import StepRefit


def test_a_failing_budget_refit_leaves_the_engine_serving(tiny_model_dir, monkeypatch):
    config = EngineConfig(dtype="float32", max_total_tokens=1024, chunked_prefill=True)
    engine = Engine(config, load_checkpoint(str(tiny_model_dir)), step_model=StepTimeModel())
    assert engine.budget is not None and engine.budget.follows_steps
    calls = []

    def broken(self, shape, ms):
        calls.append(ms)
        raise ValueError("cannot convert float NaN to integer")

    monkeypatch.setattr(StepRefit, "observe", broken)
    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    try:
        handle = engine.submit(GenerationRequest([3, 4, 5, 6], params))
        for _ in range(20):  # a prefill and four decodes, then nothing to run
            engine.step()
        out = handle.result(timeout_s=5)
    finally:
        engine.shutdown()
    assert out.output_tokens == 5 and out.finish_reason == "length" and out.error is None
    assert len(calls) >= 5  # every step was observed, and failed, and the engine went on
