"""The step-time model kept true to the steps the engine actually runs.

The start-up measurement (server.model.step_timing) times the base model's forward alone, on
keys and values it has just written: a real step also schedules, runs the LoRA side and
samples, and a late chunk of a long prompt reads a past that is no longer in cache. Measured in
the engine (2-core EPYC, SmolLM2 bf16, 32 streams beside a 4,000-token prompt): steps with
prompt tokens ran 6 ms longer than modelled at a past of a few hundred tokens and 20 ms longer
at 3,500, so a budget sized from the start-up model alone let those steps run past the target.

`StepRefit` watches every step's shape and wall time and, every `WINDOW` steps of a kind,
estimates that kind's costs again from the window and moves the model halfway there (a window
covers only part of a long prompt; halfway damps the swing from one window to the next):
- decode steps: the fixed cost `decode_ms`, by the median gap between real and modelled;
- steps with prompt tokens: their fixed cost `mixed_fixed_ms` and the cost of the past a prompt
  token attends to, `ms_per_token_past` (Theil-Sen: the median of the slopes between every
  two steps, robust to the odd slow step), the latter only where the window's pasts differ
  enough for a slope to show (else the fixed cost alone).
The other slopes (a decode row, a prompt token) come from the controlled start-up measurement:
a running engine's steps are whatever the traffic makes them, too correlated to fit them on.
Steps of prompt tokens without decodes (server.sched.step_budget's steps without decodes, of
hundreds of tokens) are left out: the budget's target is for steps streams wait on, and a
large step's tokens cost less each than the start-up slope says (larger matrix products), so
such steps pulled the fitted fixed cost below zero (-16 ms) and the budget of steps with
decodes past the target.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from toppings.server.sched.step_budget import StepTimeModel

if TYPE_CHECKING:
    from toppings.server.sched.scheduler import StepPlan

WINDOW = 64  # steps of one kind between two corrections
MAX_GAP_MS = 1000.0  # a window further off than this is a stall, not the model
MIN_PAST_SPREAD_MS = 5.0  # modelled past cost between a window's extremes to fit its slope


@dataclass(frozen=True)
class StepShape:
    """What a step computed: its decode rows, its prompt tokens and the past they attend to in
    all (a chunk of n tokens after P: n x (P + (n - 1) / 2), each `ms_per_token_past`)."""

    num_decodes: int
    prompt_tokens: int = 0
    past_work: float = 0.0


class StepRefit:
    """Corrects a step-time model from observed steps; see the module docstring."""

    def __init__(self, model: StepTimeModel, window: int = WINDOW):
        self.model = model
        self.window = window
        self.num_refits = 0
        self._decode: list[tuple[StepShape, float]] = []
        self._mixed: list[tuple[StepShape, float]] = []

    def observe(self, shape: StepShape, ms: float) -> StepTimeModel | None:
        """Record a step that took `ms`; returns the corrected model when a window of its kind
        is full (None otherwise)."""
        if shape.prompt_tokens and not shape.num_decodes:
            return None  # no stream waits on it: the budget's target is not its (see below)
        steps = self._mixed if shape.prompt_tokens else self._decode
        steps.append((shape, ms))
        if len(steps) < self.window:
            return None
        window = list(steps)
        steps.clear()
        model = self._mixed_fit(window) if shape.prompt_tokens else self._decode_fit(window)
        if model is None:
            return None
        self.model = model
        self.num_refits += 1
        return model

    def _decode_fit(self, window: list[tuple[StepShape, float]]) -> StepTimeModel | None:
        m = self.model
        gap = statistics.median(ms - m.decode_step_ms(s.num_decodes) for s, ms in window)
        if abs(gap) > MAX_GAP_MS:
            return None
        return replace(m, decode_ms=m.decode_ms + gap / 2)

    def _mixed_fit(self, window: list[tuple[StepShape, float]]) -> StepTimeModel | None:
        m = self.model
        # what the window says of a step's fixed cost plus its past's, the rest as modelled
        base = [ms - m.mixed_step_ms(s.num_decodes, s.prompt_tokens) for s, ms in window]
        rest = [(s.past_work, y + m.mixed_fixed_ms) for (s, _), y in zip(window, base)]
        slope = m.ms_per_token_past
        pasts = [x for x, _ in rest]
        if slope and slope * (max(pasts) - min(pasts)) >= MIN_PAST_SPREAD_MS:
            slope = max(_theil_sen(rest), 0.0)
        fixed = statistics.median(y - slope * x for x, y in rest)
        if abs(fixed - m.mixed_fixed_ms) > MAX_GAP_MS:
            return None
        return replace(
            m,
            mixed_fixed_ms=(m.mixed_fixed_ms + fixed) / 2,
            ms_per_token_past=(m.ms_per_token_past + slope) / 2,
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
