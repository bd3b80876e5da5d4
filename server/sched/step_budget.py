"""The token budget of a chunked-prefill step (`--max-num-batched-tokens` when it is 0).

A mixed step's time grows with the tokens it computes, and every running stream waits for the
whole step between two of its tokens. So the budget is what a full batch of decodes plus the
most prompt tokens whose modelled step time stays within an inter-token target take:
`--itl-target-ms`, or by default twice the modelled decode step at `--max-batch-size` (a step
may add one decode step's worth of prompt work to the decode it would run anyway). The model
is linear, as bench/sim_engine.py's `StepModel` fitted on the real engine: a decode step of B
requests takes `decode_ms + decode_ms_per_request * B`, each prompt token beside it
`ms_per_token` more. The default numbers are that fit for SmolLM2, float32, on a 2-core Xeon
VM (bench/sim_engine.py `measure_steps`); the engine does not measure its own machine at
start-up, so on other hardware `--itl-target-ms` or the budget itself should be given. The
result is clamped to [max(MIN_BUDGET, batch size + MIN_CHUNK), max_prefill_tokens].
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_BUDGET = 256  # below this, per-step overheads dominate the prompt work (vLLM's floor too)
MIN_CHUNK = 64  # prompt tokens a full batch of decodes leaves a step at least


@dataclass(frozen=True)
class StepTimeModel:
    """Linear step times in ms (see the module docstring for where the defaults come from)."""

    ms_per_token: float = 1.09
    decode_ms: float = 64.6
    decode_ms_per_request: float = 2.09
    source: str = (
        "bench/sim_engine.py's fit of SmolLM2 float32 on a 2-core Xeon VM, not this machine's"
    )

    def decode_step_ms(self, batch_size: int) -> float:
        return self.decode_ms + self.decode_ms_per_request * batch_size

    def prompt_tokens_within(self, target_ms: float, batch_size: int) -> int:
        """The most prompt tokens a step of batch_size decodes takes on within target_ms."""
        return max(0, int((target_ms - self.decode_step_ms(batch_size)) / self.ms_per_token))


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
    modelled = max_batch_size + model.prompt_tokens_within(target, max_batch_size)
    floor = max(MIN_BUDGET, max_batch_size + MIN_CHUNK)
    ceiling = max(max_prefill_tokens, floor)
    tokens = max(floor, min(modelled, ceiling))
    source = "--itl-target-ms" if itl_target_ms else "2x the decode step"
    how = (
        f"{max_batch_size} decodes (a {model.decode_step_ms(max_batch_size):.0f} ms step, "
        f"modelled) and the prompt tokens ({model.ms_per_token} ms each) that keep the step "
        f"within an inter-token target of {target:.0f} ms ({source}): {modelled}, clamped to "
        f"[{floor}, {ceiling}]; step model: {model.source}"
    )
    return StepBudget(tokens, target, how)
