"""The step-time model kept true to the steps the engine actually runs.

The start-up measurement (server.model.step_timing) is only a prior: it times the base model's
forward alone, once, on keys and values it has just written, and whatever else ran on the
machine then is in it (a server started beside another loading a model measured its decode
steps 10x too slow, and a refit that moved the model halfway every 64 steps, ignoring windows
more than a second off as stalls, never recovered). A real step also schedules, runs the LoRA
side and samples, and a late chunk of a long prompt reads a past that is no longer in cache.

`StepRefit` keeps the last `WINDOW` steps of each kind (decode steps; steps with prompt tokens
beside decodes) and every `REFIT_EVERY` steps fits the model to them again, robustly:
- a step is left out where its time is more than `OUTLIER` times off the median of the recent
  steps' time against the model (a page fault, a neighbour's burst); the rule is relative to
  the steps, not to the model, so a model 10x off is corrected, not its steps dropped;
- decode steps: where their batch sizes spread, the decode line by Theil-Sen (the median of the
  slopes between every two steps); otherwise the whole line scaled by the median ratio of real
  to modelled time. While no step with prompt tokens was seen of late, that ratio scales their
  costs too: what the decode steps show of the machine's speed is the best guess for them;
- steps with prompt tokens: what they take beyond the decode line, against the modelled cost of
  their prompt tokens, their past and their decode rows' extra, scaled by the median ratio;
  then the cost of the past a prompt token attends to (`ms_per_token_past`, Theil-Sen) where the
  window's pasts differ enough for a slope to show, and the fixed cost (`mixed_fixed_ms`) by
  the median of what is left;
- where only steps with prompt tokens were seen of late and the model is more than `GROSS_OFF`
  times off their median, that ratio scales the whole model first (the decode line, and with
  it the default target, cannot be seen in them otherwise).
Medians over a window of a few dozen steps move with a slower machine within `REFIT_EVERY`
steps of half the window showing it, and one slow step among them moves nothing much.
The batch the engine runs now (the median decode rows of the last `BATCH_STEPS` steps) goes
into the model: the default inter-token target follows it (server.sched.step_budget).
Steps of prompt tokens without decodes (server.sched.step_budget's steps without decodes, of
hundreds of tokens) are left out: the budget's target is for steps streams wait on, and a
large step's tokens cost less each than the start-up slope says (larger matrix products).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from toppings.server.sched.step_budget import StepTimeModel

if TYPE_CHECKING:
    from toppings.server.sched.scheduler import StepPlan

WINDOW = 24  # recent steps of one kind a fit looks at
REFIT_EVERY = 4  # steps between two fits
MIN_STEPS = 6  # steps of a kind in its window before they are fitted on
OUTLIER = 3.0  # a step this many times slower or faster than the recent steps' median is out
MIN_PAST_SPREAD_MS = 5.0  # modelled past cost between a window's extremes to fit its slope
BATCH_STEPS = 8  # recent steps whose median decode rows are the current batch
MIN_SCALE = 0.05  # least a fit scales the cost of prompt tokens by at once
GROSS_OFF = 2.0  # steps with prompt tokens this far off the model alone scale all of it
# A prompt token's fitted costs (its own, its past's) stay within this factor of the prior's,
# scaled by how much faster or slower the decode line now is than the prior's. Steps of a few
# prompt tokens beside decodes are nearly all fixed cost: a fit on them drove the token's cost
# towards 0, the budget to --max-prefill-tokens, and the resulting multi-second step was then
# left out as an outlier, so nothing corrected it (bench_chunked_prefill, 2.5 s gaps).
PROMPT_COST_BAND = 4.0


@dataclass(frozen=True)
class StepShape:
    """What a step computed: its decode rows, its prompt tokens and the past they attend to in
    all (a chunk of n tokens after P: n x (P + (n - 1) / 2), each `ms_per_token_past`)."""

    num_decodes: int
    prompt_tokens: int = 0
    past_work: float = 0.0


def modelled_ms(model: StepTimeModel, shape: StepShape) -> float:
    """The time `model` gives a step of `shape`, its past included."""
    ms = model.mixed_step_ms(shape.num_decodes, shape.prompt_tokens)
    return ms + model.ms_per_token_past * shape.past_work


def scaled(model: StepTimeModel, factor: float) -> StepTimeModel:
    """`model` with every cost `factor` times what it was."""
    return replace(
        model,
        ms_per_token=model.ms_per_token * factor,
        decode_ms=model.decode_ms * factor,
        decode_ms_per_request=model.decode_ms_per_request * factor,
        ms_per_token_past=model.ms_per_token_past * factor,
        mixed_ms_per_request=model.mixed_ms_per_request * factor,
        mixed_fixed_ms=model.mixed_fixed_ms * factor,
    )


class StepRefit:
    """Corrects a step-time model from observed steps; see the module docstring."""

    def __init__(self, model: StepTimeModel, window: int = WINDOW, every: int = REFIT_EVERY):
        self.model = model
        self.prior = model
        self.window = window
        self.every = every
        self.num_refits = 0
        self.num_steps = 0
        self._decode: deque[tuple[int, StepShape, float]] = deque(maxlen=window)
        self._mixed: deque[tuple[int, StepShape, float]] = deque(maxlen=window)
        self._batches: deque[int] = deque(maxlen=BATCH_STEPS)

    def observe(self, shape: StepShape, ms: float) -> StepTimeModel | None:
        """Record a step that took `ms`; returns the refitted model every `every` steps once
        a kind has MIN_STEPS steps (None otherwise)."""
        if shape.prompt_tokens and not shape.num_decodes:
            return None  # no stream waits on it: the budget's target is not its (see above)
        if not (math.isfinite(ms) and ms > 0):
            return None  # a clock that stepped, not a step's time
        self.num_steps += 1
        steps = self._mixed if shape.prompt_tokens else self._decode
        steps.append((self.num_steps, shape, ms))
        self._batches.append(shape.num_decodes)
        if self.num_steps % self.every:
            return None
        recent = self.num_steps - 2 * self.window  # a kind not seen since is not "of late"
        least = min(MIN_STEPS, self.window)
        decode = _inliers(self.model, [(s, ms) for _, s, ms in self._decode], least)
        mixed = _inliers(self.model, [(s, ms) for _, s, ms in self._mixed], least)
        mixed_lately = bool(self._mixed) and self._mixed[-1][0] > recent
        decode_lately = bool(self._decode) and self._decode[-1][0] > recent
        if not decode and not mixed:
            return None
        model = self.model
        if decode:
            model = _fit_decode(model, decode, scale_rest=not (mixed and mixed_lately))
        elif mixed and not GROSS_OFF**-1 < (ratio := _median_ratio(model, mixed)) < GROSS_OFF:
            model = scaled(model, ratio)  # the machine's speed, from steps with prompt tokens
        if mixed and (mixed_lately or not decode_lately):
            model = _fit_mixed(model, mixed)
        batch = round(statistics.median(self._batches))
        model = _within_band(model, self.prior, batch)
        if not is_sane(model):
            return None  # a degenerate window (steps of one shape, extreme times): keep the last
        self.model = replace(model, batch_size=batch, source=self._source())
        self.num_refits += 1
        return self.model

    def _source(self) -> str:
        return (
            f"refit from the last {len(self._decode)} decode steps and {len(self._mixed)} "
            f"with prompt tokens; prior: {self.prior.source}"
        )


def is_sane(model: StepTimeModel) -> bool:
    """Whether every cost of `model` is finite, none negative, and a prompt token and a decode
    step cost something (what the budget divides by)."""
    costs = (model.ms_per_token, model.decode_ms, model.decode_ms_per_request,
             model.ms_per_token_past, model.mixed_ms_per_request)  # fmt: skip
    finite = all(math.isfinite(c) for c in (*costs, model.mixed_fixed_ms))
    return finite and min(costs) >= 0 and model.ms_per_token > 0 and model.decode_step_ms(1) > 0


def _median_ratio(model: StepTimeModel, steps: list[tuple[StepShape, float]]) -> float:
    return statistics.median(ms / max(modelled_ms(model, s), 1e-9) for s, ms in steps)


def _inliers(
    model: StepTimeModel, steps: list[tuple[StepShape, float]], least: int
) -> list[tuple[StepShape, float]]:
    """The steps within OUTLIER of the median ratio of real to modelled time; [] where fewer
    than `least`."""
    if len(steps) < least:
        return []
    ratios = [ms / max(modelled_ms(model, s), 1e-9) for s, ms in steps]
    mid = statistics.median(ratios)
    kept = [p for p, r in zip(steps, ratios) if mid / OUTLIER <= r <= mid * OUTLIER]
    return kept if len(kept) >= least else []


def _fit_decode(
    model: StepTimeModel, steps: list[tuple[StepShape, float]], scale_rest: bool
) -> StepTimeModel:
    """The decode line through the decode steps (see the module docstring); with scale_rest
    the other costs scaled by what it moved at the steps' median batch."""
    points = [(float(s.num_decodes), ms) for s, ms in steps]
    batches = sorted({b for b, _ in points})
    mid = statistics.median(b for b, _ in points)
    before = model.decode_step_ms(int(mid))
    if len(batches) >= 3 and batches[-1] >= 2 * max(batches[0], 1.0):
        slope = max(_theil_sen(points), 0.0)
        fixed = statistics.median(ms - slope * b for b, ms in points)
        fitted = replace(model, decode_ms=fixed, decode_ms_per_request=slope)
    else:
        ratio = _median_ratio(model, steps)
        fitted = replace(
            model,
            decode_ms=model.decode_ms * ratio,
            decode_ms_per_request=model.decode_ms_per_request * ratio,
        )
    if not scale_rest or before <= 0:
        return fitted
    factor = max(fitted.decode_step_ms(int(mid)), 1e-9) / before
    rest = scaled(model, factor)
    return replace(fitted, ms_per_token=rest.ms_per_token,
                   ms_per_token_past=rest.ms_per_token_past,
                   mixed_ms_per_request=rest.mixed_ms_per_request,
                   mixed_fixed_ms=rest.mixed_fixed_ms)  # fmt: skip


def _fit_mixed(model: StepTimeModel, steps: list[tuple[StepShape, float]]) -> StepTimeModel:
    """The costs of prompt tokens, their past and their step's fixed extra through the steps
    with prompt tokens, beyond the decode line (see the module docstring)."""
    m = model
    beyond = [ms - m.decode_step_ms(s.num_decodes) for s, ms in steps]  # [n]

    scale = statistics.median(
        (y - m.mixed_fixed_ms) / max(_variable_ms(s, m), 1e-9) for (s, _), y in zip(steps, beyond)
    )
    m = replace(
        m,
        ms_per_token=m.ms_per_token * max(scale, MIN_SCALE),
        ms_per_token_past=m.ms_per_token_past * max(scale, MIN_SCALE),
        mixed_ms_per_request=m.mixed_ms_per_request * max(scale, MIN_SCALE),
    )
    # what is left of each step beyond its tokens' own cost: the fixed extra and the past's
    rest = [
        (s.past_work, y - m.mixed_ms_per_request * s.num_decodes - m.ms_per_token * s.prompt_tokens)
        for (s, _), y in zip(steps, beyond)
    ]
    slope = m.ms_per_token_past
    pasts = [x for x, _ in rest]
    if slope and slope * (max(pasts) - min(pasts)) >= MIN_PAST_SPREAD_MS:
        slope = max(_theil_sen(rest), 0.0)
    fixed = statistics.median(y - slope * x for x, y in rest)
    return replace(m, ms_per_token_past=slope, mixed_fixed_ms=fixed)


def _variable_ms(s: StepShape, m: StepTimeModel) -> float:
    """What a step with prompt tokens costs beyond the decode line and its fixed extra."""
    return (m.mixed_ms_per_request * s.num_decodes + m.ms_per_token * s.prompt_tokens
            + m.ms_per_token_past * s.past_work)  # fmt: skip


def _within_band(model: StepTimeModel, prior: StepTimeModel, batch: int) -> StepTimeModel:
    """`model` with its prompt-token costs held within PROMPT_COST_BAND of the prior's, scaled by
    the machine's speed as the decode line shows it at `batch` (see PROMPT_COST_BAND)."""
    speed = model.decode_step_ms(max(batch, 1)) / max(prior.decode_step_ms(max(batch, 1)), 1e-9)

    def held(value: float, prior_value: float) -> float:
        if prior_value <= 0:
            return value
        centre = prior_value * speed
        return min(max(value, centre / PROMPT_COST_BAND), centre * PROMPT_COST_BAND)

    return replace(
        model,
        ms_per_token=held(model.ms_per_token, prior.ms_per_token),
        ms_per_token_past=held(model.ms_per_token_past, prior.ms_per_token_past),
    )


def _theil_sen(points: list[tuple[float, float]]) -> float:
    """The median of the slopes between every two points of different x."""
    slopes = [
        (y2 - y1) / (x2 - x1)
        for i, (x1, y1) in enumerate(points)
        for x2, y2 in points[i + 1 :]
        if x2 != x1
    ]
    return statistics.median(slopes) if slopes else 0.0


def shape_of(plan: StepPlan) -> StepShape:
    """The shape of `plan` before it runs (its requests' `num_prefilled` not yet advanced)."""
    decodes, tokens, past = 0, 0, 0.0
    for seq, n in zip(plan.seqs, plan.tokens):
        if seq.is_prefilled:
            decodes += 1
        else:
            tokens += n
            past += n * (seq.num_prefilled + (n - 1) / 2)
    return StepShape(decodes, tokens, past)
