"""The token budget of a chunked-prefill step (`--max-num-batched-tokens` when it is 0).

A mixed step's time grows with the tokens it computes; every running stream waits for the whole
step between two of its tokens. So the budget is the most tokens whose modelled step time stays
within an inter-token target: `--itl-target-ms`, or by default twice the modelled decode step
at `--max-batch-size` (a step may then add one decode step's worth of prompt work to the decode
it would have run anyway). The model is linear, as bench/sim_engine.py's `StepModel` fitted on
the real engine: a step of T tokens takes `step_ms + ms_per_token * T`, a decode step of B
requests `decode_ms + decode_ms_per_request * B`. The default numbers are its fit of SmolLM2,
float32, on a 2-core Xeon VM (bench/sim_engine.py `measure_steps`); the engine does not measure
its own machine at start-up, so on other hardware `--itl-target-ms` or the budget itself should
be given. The result is clamped to [MIN_BUDGET, max_prefill_tokens] and above the batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_BUDGET = 256  # below this, per-step overheads dominate the prompt work (vLLM's floor too)
MIN_CHUNK = 64  # prompt tokens a full batch of decodes leaves a step at least


@dataclass(frozen=True)
class StepTimeModel:
    """Linear step times in ms (see the module docstring for where the defaults come from)."""

    step_ms: float = 19.7
    ms_per_token: float = 1.09
    decode_ms: float = 64.6
    decode_ms_per_request: float = 2.09

    def decode_step_ms(self, batch_size: int) -> float:
        return self.decode_ms + self.decode_ms_per_request * batch_size

    def max_tokens_within(self, target_ms: float) -> int:
        """The most tokens one step computes within target_ms."""
        return max(0, int((target_ms - self.step_ms) / self.ms_per_token))


@dataclass(frozen=True)
class StepBudget:
    """The chosen budget and how it was derived (logged at start-up)."""

    tokens: int
    itl_target_ms: float
    how: str


def choose_step_budget(
    max_batch_size: int,
    max_prefill_tokens: int,
    max_num_batched_tokens: int = 0,
    itl_target_ms: float = 0.0,
    model: StepTimeModel | None = None,
) -> StepBudget:
    """The step token budget: `max_num_batched_tokens` when given, else derived from the step
    time model and the inter-token target (0: twice the decode step at max_batch_size)."""
    model = model or StepTimeModel()
    target = itl_target_ms or 2 * model.decode_step_ms(max_batch_size)
    if max_num_batched_tokens:
        return StepBudget(max_num_batched_tokens, target, "given by --max-num-batched-tokens")
    modelled = model.max_tokens_within(target)
    floor = max(MIN_BUDGET, max_batch_size + MIN_CHUNK)
    tokens = max(floor, min(modelled, max(max_prefill_tokens, floor)))
    source = "--itl-target-ms" if itl_target_ms else f"2x the decode step at {max_batch_size}"
    how = (
        f"the most tokens whose modelled step time ({model.step_ms} ms + {model.ms_per_token} "
        f"ms/token) stays within an inter-token target of {target:.0f} ms ({source}): "
        f"{modelled}, clamped to [{floor}, {max(max_prefill_tokens, floor)}]"
    )
    return StepBudget(tokens, target, how)
