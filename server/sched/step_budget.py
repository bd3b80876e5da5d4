"""The token budget of a chunked-prefill step (`--max-num-batched-tokens` when it is 0).

A mixed step's time grows with the tokens it computes, and every running stream waits for the
whole step between two of its tokens. So the budget is what the batch's decodes plus the most
prompt tokens whose modelled step time stays within an inter-token target take:
`--itl-target-ms`, or by default `ITL_MULTIPLE` times the modelled decode step at the batch the
engine runs now (a step may add two decode steps' worth of prompt work to the decode it would
run anyway: a stream's largest gap stays within a few of its usual ones, and a long prompt
beside 16 streams takes a few dozen steps, not hundreds; before any step ran, at
`--max-batch-size`). The model is linear: a decode step of B requests takes
`decode_ms + decode_ms_per_request * B`, each prompt token beside it `ms_per_token` more, and
`ms_per_token_past` more for each token of past it attends to. The engine measures it at
start-up on its own model and machine (server.model.step_timing), a prior that the steps it
really runs then correct within a few dozen steps (server.sched.step_refit); the defaults here
are bench/sim_engine.py's fit of SmolLM2, float32, on a 2-core Xeon VM, for the simulator and
for tests.

The budget is at least the batch's decodes plus `MIN_CHUNK` prompt tokens, and plus as many
prompt tokens as a step's fixed cost (`decode_ms`) is worth, so that a chunk's work is never
smaller than the per-step overhead it pays: on a GPU, where a prompt token costs microseconds,
that floor is in the thousands; on a CPU, where a prompt token costs about as much as a decode
row, it is a few dozen and the inter-token target decides. At most `max_prefill_tokens` (or a
full batch plus `MIN_CHUNK`, where that is more).

A step with no decode has no stream waiting on it: its budget is sized instead so that the step's
fixed cost is at most a tenth of it (`LONE_STEP_OVERHEAD`). On a 2-core CPU the target's budget
for every step made a long prompt served alone take 1.5-1.7x its unchunked prefill (~75 steps
of ~100 tokens, ~26 of them late in a 2,500-token prompt, each step reading the weights again).
A request arriving meanwhile waits for that step (about ten fixed costs) before its own prompt
shares the next one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

MIN_CHUNK = 16  # prompt tokens a full batch of decodes leaves a step at least
ITL_MULTIPLE = 3.0  # the default inter-token target, in decode steps at the current batch
LONE_STEP_OVERHEAD = 0.1  # most of a step without decodes its fixed cost may be


class StepPoints(Protocol):
    """Measured step times in ms (server.model.step_timing.StepTimes)."""

    decode_ms: dict[int, float]  # decode steps by batch size
    chunk_ms: dict[int, float]  # a chunk of chunk_tokens by the length of its past
    mixed_ms: dict[int, float]  # mixed_rows decodes beside prompt tokens, by prompt tokens
    mixed_rows: int
    chunk_tokens: int

    def describe(self) -> str: ...


@dataclass(frozen=True)
class StepTimeModel:
    """Linear step times in ms (see the module docstring for where the defaults come from)."""

    ms_per_token: float = 1.09
    decode_ms: float = 64.6
    decode_ms_per_request: float = 2.09
    # more per prompt token for each token of its past it attends to (a late chunk of a long
    # prompt); 0: not measured
    ms_per_token_past: float = 0.0
    # more a decode row costs in a step with prompt tokens than in a decode step
    mixed_ms_per_request: float = 0.0
    # more a step with prompt tokens costs, fixed (what the forward alone does not show:
    # server.sched.step_refit measures it on the running engine)
    mixed_fixed_ms: float = 0.0
    source: str = (
        "bench/sim_engine.py's fit of SmolLM2 float32 on a 2-core Xeon VM, not this machine's"
    )
    # the decode batch the engine runs now (server.sched.step_refit); 0: not seen yet
    batch_size: int = 0

    @classmethod
    def fit(cls, points: StepPoints) -> StepTimeModel:
        """The model through measured points (least squares; a negative slope, timing noise,
        counts as free): the decode line from the decode steps, a prompt token's cost from
        the mixed steps, a decode row's extra in them from their intercept, and the past's
        weight from the chunks (none with one chunk point)."""
        per_request, fixed = _line(points.decode_ms)
        ms_per_token, mixed_fixed = _line(points.mixed_ms)
        chunk_slope = _line(points.chunk_ms)[0] if len(points.chunk_ms) > 1 else 0.0
        rows = points.mixed_rows
        extra = (mixed_fixed - fixed - per_request * rows) / rows
        return cls(
            ms_per_token=max(ms_per_token, 1e-6),
            decode_ms=fixed,
            decode_ms_per_request=max(per_request, 0.0),
            ms_per_token_past=max(chunk_slope / points.chunk_tokens, 0.0),
            mixed_ms_per_request=max(extra, 0.0),
            source=points.describe(),
        )

    def past_weight(self) -> float:
        """Budget tokens a prompt token costs more for each token of past it attends to."""
        return self.ms_per_token_past / self.ms_per_token

    def decode_step_ms(self, batch_size: int) -> float:
        return self.decode_ms + self.decode_ms_per_request * batch_size

    def overhead_tokens(self) -> int:
        """Prompt tokens whose work equals a step's fixed cost (`decode_ms`)."""
        return math.ceil(max(self.decode_ms, 0.0) / self.ms_per_token)

    def _mixed_decodes_ms(self, batch_size: int) -> float:
        """What batch_size decodes cost a step that also computes prompt tokens."""
        extra = self.mixed_ms_per_request * batch_size + self.mixed_fixed_ms
        return self.decode_step_ms(batch_size) + extra

    def mixed_step_ms(self, batch_size: int, prompt_tokens: int) -> float:
        """A step of batch_size decodes and prompt_tokens prompt tokens (at no past)."""
        if not prompt_tokens:
            return self.decode_step_ms(batch_size)
        return self._mixed_decodes_ms(batch_size) + self.ms_per_token * prompt_tokens

    def prompt_tokens_within(self, target_ms: float, batch_size: int) -> int:
        """The most prompt tokens a step of batch_size decodes takes on within target_ms."""
        # never less than their decode step: a fit's negative fixed extra is the noise of a
        # window, and taken as it was it gave a whole long prompt one multi-second step
        decodes = max(self._mixed_decodes_ms(batch_size), self.decode_step_ms(batch_size))
        tokens = (target_ms - decodes) / self.ms_per_token
        return max(0, int(tokens)) if math.isfinite(tokens) else 0  # 0: the budget's floor


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
    # the budget of a step without decodes; 0: `tokens` (a budget given by the flag)
    lone_tokens: int = 0


def choose_step_budget(
    max_batch_size: int,
    max_prefill_tokens: int,
    max_num_batched_tokens: int = 0,
    itl_target_ms: float = 0.0,
    model: StepTimeModel | None = None,
) -> StepBudget:
    """The step token budget: `max_num_batched_tokens` when given, else derived from the step
    time model and the inter-token target (0: ITL_MULTIPLE x the decode step at the model's
    current batch, or at max_batch_size before it has one) for the model's current batch."""
    if max_num_batched_tokens:  # the target is not used (0 unless given)
        how = "given by --max-num-batched-tokens"
        return StepBudget(max_num_batched_tokens, itl_target_ms, how)
    model = model or StepTimeModel()
    batch = min(max(model.batch_size, 1), max_batch_size) if model.batch_size else max_batch_size
    target = itl_target_ms or ITL_MULTIPLE * model.decode_step_ms(batch)
    modelled = batch + model.prompt_tokens_within(target, batch)
    ceiling = max(max_prefill_tokens, max_batch_size + MIN_CHUNK)
    floor = min(batch + max(MIN_CHUNK, model.overhead_tokens()), ceiling)
    tokens = max(floor, min(modelled, ceiling))
    # a step without decodes: its fixed cost (as refit from real steps) a tenth of it
    fixed_ms = max(model.mixed_step_ms(0, 1) - model.ms_per_token, 0.0)
    lone = math.ceil(fixed_ms / model.ms_per_token * (1 / LONE_STEP_OVERHEAD - 1))
    lone = max(tokens, min(lone, ceiling))
    source = "--itl-target-ms" if itl_target_ms else f"{ITL_MULTIPLE:g}x the decode step"
    how = (
        f"{batch} decodes (a {model.decode_step_ms(batch):.0f} ms step, modelled) and the "
        f"prompt tokens ({model.ms_per_token:.3g} ms each) that keep the step within an "
        f"inter-token target of {target:.0f} ms ({source} at a batch of {batch}): {modelled}, "
        f"clamped to [{floor}, {ceiling}]; {lone} in a step without decodes (its fixed cost at "
        f"most a tenth); a prompt token after a past of P counts 1 + "
        f"{model.past_weight():.2g} x P; step model: {model.source}"
    )
    return StepBudget(tokens, target, how, model.past_weight(), lone)
