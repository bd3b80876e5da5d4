"""The token budget of a chunked-prefill step (`--max-num-batched-tokens` when it is 0).

A mixed step's time grows with the tokens it computes, and every running stream waits for the
whole step between two of its tokens. So the budget is what a full batch of decodes plus the
most prompt tokens whose modelled step time stays within an inter-token target take:
`--itl-target-ms`, or by default twice the modelled decode step at `--max-batch-size` (a step
may add one decode step's worth of prompt work to the decode it would run anyway). The model
is linear: a decode step of B requests takes `decode_ms + decode_ms_per_request * B`, each
prompt token beside it `ms_per_token` more. The engine measures it at start-up on its own
model and machine (server.engine.step_timing); the defaults here are bench/sim_engine.py's fit
of SmolLM2, float32, on a 2-core Xeon VM, for the simulator and for tests.

The budget is at least a full batch of decodes plus `MIN_CHUNK` prompt tokens, and plus as many
prompt tokens as a step's fixed cost (`decode_ms`) is worth, so that a chunk's work is never
smaller than the per-step overhead it pays: on a GPU, where a prompt token costs microseconds,
that floor is in the thousands; on a CPU, where a prompt token costs about as much as a decode
row, it is a few dozen and the inter-token target decides. At most `max_prefill_tokens` (or a
full batch plus `MIN_CHUNK`, where that is more).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_CHUNK = 16  # prompt tokens a full batch of decodes leaves a step at least


@dataclass(frozen=True)
class StepTimeModel:
    """Linear step times in ms (see the module docstring for where the defaults come from)."""

    ms_per_token: float = 1.09
    decode_ms: float = 64.6
    decode_ms_per_request: float = 2.09
    # more per prompt token for each token of its past it attends to (a late chunk of a long
    # prompt); 0: not measured
    ms_per_token_past: float = 0.0
    source: str = (
        "bench/sim_engine.py's fit of SmolLM2 float32 on a 2-core Xeon VM, not this machine's"
    )

    @classmethod
    def fit(
        cls,
        decode_ms: dict[int, float],
        prefill_ms: dict[int, float],
        chunk_ms: dict[int, float],
        chunk_tokens: int,
        source: str,
    ):
        """The model through measured points: decode steps {batch size: ms}, prefills {prompt
        tokens: ms}, two or more of each, and chunks of `chunk_tokens` {past tokens: ms}, one
        or more (least squares); a negative slope (timing noise) counts as free."""
        per_request, fixed = _line(decode_ms)
        ms_per_token, _ = _line(prefill_ms)
        per_past = _line(chunk_ms)[0] / chunk_tokens if len(chunk_ms) > 1 else 0.0
        return cls(max(ms_per_token, 1e-6), fixed, max(per_request, 0.0), max(per_past, 0.0),
                   source)  # fmt: skip

    def past_weight(self) -> float:
        """Budget tokens a prompt token costs more for each token of past it attends to."""
        return self.ms_per_token_past / self.ms_per_token

    def decode_step_ms(self, batch_size: int) -> float:
        return self.decode_ms + self.decode_ms_per_request * batch_size

    def overhead_tokens(self) -> int:
        """Prompt tokens whose work equals a step's fixed cost (`decode_ms`)."""
        return math.ceil(max(self.decode_ms, 0.0) / self.ms_per_token)

    def prompt_tokens_within(self, target_ms: float, batch_size: int) -> int:
        """The most prompt tokens a step of batch_size decodes takes on within target_ms."""
        return max(0, int((target_ms - self.decode_step_ms(batch_size)) / self.ms_per_token))


def _line(points: dict[int, float]) -> tuple[float, float]:
    """Slope and intercept of the least-squares line through {x: y}."""
    xs, ys = list(points), list(points.values())
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return slope, mean_y - slope * mean_x


@dataclass(frozen=True)
class StepBudget:
    """The chosen budget and how it was derived (logged at start-up)."""

    tokens: int
    itl_target_ms: float
    how: str
    # a prompt token counts 1 + past_weight x its past against the budget (GateLimits); 0: 1
    past_weight: float = 0.0


def choose_step_budget(
    max_batch_size: int,
    max_prefill_tokens: int,
    max_num_batched_tokens: int = 0,
    itl_target_ms: float = 0.0,
    model: StepTimeModel | None = None,
) -> StepBudget:
    """The step token budget: `max_num_batched_tokens` when given, else derived from the step
    time model and the inter-token target (0: twice the decode step at max_batch_size)."""
    if max_num_batched_tokens:  # the target is not used (0 unless given)
        how = "given by --max-num-batched-tokens"
        return StepBudget(max_num_batched_tokens, itl_target_ms, how)
    model = model or StepTimeModel()
    target = itl_target_ms or 2 * model.decode_step_ms(max_batch_size)
    modelled = max_batch_size + model.prompt_tokens_within(target, max_batch_size)
    ceiling = max(max_prefill_tokens, max_batch_size + MIN_CHUNK)
    floor = min(max_batch_size + max(MIN_CHUNK, model.overhead_tokens()), ceiling)
    tokens = max(floor, min(modelled, ceiling))
    source = "--itl-target-ms" if itl_target_ms else "2x the decode step"
    how = (
        f"{max_batch_size} decodes (a {model.decode_step_ms(max_batch_size):.0f} ms step, "
        f"modelled) and the prompt tokens ({model.ms_per_token:.3g} ms each) that keep the step "
        f"within an inter-token target of {target:.0f} ms ({source}): {modelled}, clamped to "
        f"[{floor}, {ceiling}]; a prompt token after a past of P counts "
        f"1 + {model.past_weight():.2g} x P; step model: {model.source}"
    )
    return StepBudget(tokens, target, how, model.past_weight())
