"""The step-time model kept true to the steps the engine actually runs.

The start-up measurement (server.model.step_timing) is only a prior: it times the base model's
forward alone, once, on keys and values it has just written, and whatever else ran on the
machine then is in it (a server started beside another loading a model measured its decode steps an
order of magnitude too slow, and a refit that moved the model halfway every 64 steps, ignoring
windows more than a second off as stalls, never recovered). A real step also schedules, runs the
LoRA side and samples, and a late chunk of a long prompt reads a past that is no longer in cache.

`StepRefit` keeps the last `WINDOW` steps of each kind (decode steps; steps with prompt tokens
beside decodes) and every `REFIT_EVERY` steps fits the model to them again, robustly:
- a step is left out where its time is more than `OUTLIER` times off the median of the recent
  steps' time against the model (a page fault, a neighbour's burst); the rule is relative to
  the steps, not to the model, so a model 10x off is corrected, not its steps dropped;
- decode steps: where their batch sizes spread, the decode line by Theil-Sen (the median of the
  slopes between every two steps); otherwise the whole line scaled by the median ratio of real
  to modelled time. While no step with prompt tokens was seen of late, that ratio scales their
  costs too: what the decode steps show of the machine's speed is the best guess for them;
- steps with prompt tokens: what they take beyond the decode line and their decode rows'
  extra, fitted at once on a fixed cost (`mixed_fixed_ms`), a cost per prompt token
  (`ms_per_token`) and one per key of the past it is scored against (`ms_per_token_past`; the
  keys as the attention kernel reads them: server.sched.tiles), by least squares, again without
  the steps that fit leaves more than `RESIDUAL_OUT` median absolute deviations off. The two
  costs are held to the model's by `PRIOR_STEPS` steps' worth of weight each (ridge regression):
  a window whose chunks all have one size cannot tell a token's cost from the fixed one, nor
  a window of one past the past's from a token's, and there the model keeps what it had. The
  fit of before scaled every prompt cost by the window's median misfit, then fitted the past's
  slope only where the model's own slope made the window's pasts differ enough: a past weight
  too high was taken out of the token's cost instead, and one too low was never refitted.
  Beside few streams the budget's chunks shrink as their past grows, so a window's past work
  hardly differs and nothing moved it back. (The high past weights seen beside decodes were
  that and the rows kernel's rate together: chunks cut below a tile re-read the past once per
  token, server.sched.tiles. With chunks in whole tiles the refit's weights are steadier:
  bench/probe_long_prompt_steps.py, docs/benchmarks.md, "Measurements behind the code");
- where only steps with prompt tokens were seen of late and the model is more than `GROSS_OFF`
  times off their median, that ratio scales the whole model first (the decode line, and with
  it the default target, cannot be seen in them otherwise).
Medians over a window of a few dozen steps move with a slower machine within `REFIT_EVERY`
steps of half the window showing it, and one slow step among them moves nothing much.
The batch the engine runs now (the median decode rows of the last `BATCH_STEPS` steps) goes
into the model: the budget's one number is the one at that batch (server.sched.step_budget).
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
from toppings.server.sched.tiles import key_reads

if TYPE_CHECKING:
    from toppings.server.sched.plan import StepPlan

WINDOW = 24  # recent steps of one kind a fit looks at
REFIT_EVERY = 4  # steps between two fits
MIN_STEPS = 6  # steps of a kind in its window before they are fitted on
OUTLIER = 3.0  # a step this many times slower or faster than the recent steps' median is out
BATCH_STEPS = 8  # recent steps whose median decode rows are the current batch
MIN_SCALE = 0.05  # least a fit takes the cost of a prompt token to at once, of what it was
PRIOR_STEPS = 4.0  # steps' worth of weight that holds each cost of steps with prompt tokens
RESIDUAL_OUT = 4.0  # a step this many median absolute deviations off the joint fit is left out
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
            model = _fit_mixed(model, mixed, decode_seen=bool(decode))
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


def _fit_mixed(
    model: StepTimeModel, steps: list[tuple[StepShape, float]], decode_seen: bool = False
) -> StepTimeModel:
    """The fixed extra of steps with prompt tokens and the costs of their prompt tokens and
    past, fitted jointly to what the steps take beyond the decode line and their decode rows'
    extra (see the module docstring), once more without the steps the first fit leaves far off
    (RESIDUAL_OUT times the residuals' median absolute deviation).

    With the decode line fitted on real decode steps (`decode_seen`), a negative fixed extra is
    not the machine's (a step with prompt tokens costs no less than its decodes) but two costs
    the window cannot tell apart: chunks that shrink as their past grows (a budget's chunks
    beside a few streams) let the intercept go well below zero and a prompt token too dear, the
    steps' times fitted all the same; the fit is then made again without an intercept. Without
    decode steps the decode line is the prior's, scaled, and the intercept is what it misses."""
    m = model
    columns = [(1.0, float(s.prompt_tokens), s.past_work) for s, _ in steps]
    beyond = [ms - m.decode_step_ms(s.num_decodes) - m.mixed_ms_per_request * s.num_decodes
              for s, ms in steps]  # fmt: skip
    prior = (m.mixed_fixed_ms, m.ms_per_token, m.ms_per_token_past)
    theta = _ridge(columns, beyond, prior)
    residuals = [y - sum(t * x for t, x in zip(theta, c)) for c, y in zip(columns, beyond)]
    spread = RESIDUAL_OUT * max(statistics.median(abs(r) for r in residuals), 1e-6)
    kept = [i for i, r in enumerate(residuals) if abs(r) <= spread]
    if len(kept) < len(columns):
        columns, beyond = [columns[i] for i in kept], [beyond[i] for i in kept]
        theta = _ridge(columns, beyond, prior)
    if theta[2] < 0:  # a past that costs nothing: the others fitted without it
        theta = [*_ridge([c[:2] for c in columns], beyond, prior[:2]), 0.0]
    if theta[0] < 0 and decode_seen:  # no less than its decodes: fitted without an intercept
        theta = [0.0, *_ridge([c[1:] for c in columns], beyond, prior[1:], held_from=0)]
        if theta[2] < 0:
            theta = [0.0, *_ridge([c[1:2] for c in columns], beyond, prior[1:2], held_from=0), 0.0]
    fixed, per_token, per_past = theta
    return replace(m, mixed_fixed_ms=fixed, ms_per_token=max(per_token, m.ms_per_token * MIN_SCALE),
                   ms_per_token_past=per_past)  # fmt: skip


def _ridge(
    columns: list[tuple[float, ...]],
    ys: list[float],
    prior: tuple[float, ...],
    held_from: int = 1,
) -> list[float]:
    """Least squares of ys on the columns (the first one all ones: the intercept, unless
    `held_from` is 0), each coefficient from `held_from` on held to its prior value by the
    weight of PRIOR_STEPS rows of its column's typical size (ridge regression towards the
    prior: (X'X + L) theta = X'y + L prior)."""
    k = len(prior)
    lhs = [[sum(c[i] * c[j] for c in columns) for j in range(k)] for i in range(k)]
    rhs = [sum(c[i] * y for c, y in zip(columns, ys)) for i in range(k)]
    for i in range(held_from, k):  # the intercept is not held
        weight = PRIOR_STEPS * max(sum(c[i] ** 2 for c in columns) / len(columns), 1e-12)
        lhs[i][i] += weight
        rhs[i] += weight * prior[i]
    return _solve(lhs, rhs)


def _solve(lhs: list[list[float]], rhs: list[float]) -> list[float]:
    """x of lhs x = rhs (Gaussian elimination with partial pivoting; lhs is positive
    definite here: the ridge's weight is on its diagonal)."""
    n = len(rhs)
    a = [row[:] + [b] for row, b in zip(lhs, rhs)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            a[r] = [x - f * y for x, y in zip(a[r], a[col])]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (a[r][n] - sum(a[r][c] * x[c] for c in range(r + 1, n))) / a[r][r]
    return x


def _within_band(model: StepTimeModel, prior: StepTimeModel, batch: int) -> StepTimeModel:
    """`model` with its prompt-token costs held within PROMPT_COST_BAND of the prior's, scaled by
    the machine's speed as the decode line shows it at `batch` (see PROMPT_COST_BAND)."""
    before = prior.decode_step_ms(max(batch, 1))
    # a prior without a decode step (none measured) says nothing of the machine's speed
    speed = model.decode_step_ms(max(batch, 1)) / before if before > 0 else 1.0

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


def shape_of(plan: StepPlan, scored_weight: float = 0.0) -> StepShape:
    """The shape of `plan` before it runs (its requests' `num_prefilled` not yet advanced); a
    scored prompt's tokens (StepBudget.scored_weight) count 1 + `scored_weight` each."""
    decodes, tokens, past = 0, 0, 0.0
    for seq, n in zip(plan.seqs, plan.tokens):
        if seq.is_prefilled:
            decodes += 1
        else:
            tokens += round(n * (1 + scored_weight)) if seq.scores_prompt else n
            past += key_reads(n, seq.num_prefilled)
    return StepShape(decodes, tokens, past)
