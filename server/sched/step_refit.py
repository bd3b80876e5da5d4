"""The step-time model kept true to the steps the engine actually runs.

The start-up measurement (server.model.step_timing) times the base model's forward alone; a
real step also schedules, runs the LoRA side and samples, so real steps run a few ms longer
than modelled (on a 2-core EPYC, SmolLM2 bf16: ~4 ms for a decode step, ~14 ms for a mixed step
of 32 streams), and a budget sized from the forward alone lets mixed steps run past the
inter-token target. `StepRefit` watches each step's shape and wall time and, every `WINDOW`
steps of a kind, moves that kind's fixed cost by the median gap between real and modelled
(decode steps: `decode_ms`; steps with prompt tokens: `mixed_fixed_ms`, on top). Only the fixed
costs move: the slopes come from the controlled start-up measurement, while a running engine's
steps are whatever the traffic makes them, too correlated (long steps are the full ones) to fit
slopes on. A median over a window is robust to the odd slow step (a page fault, a log flush).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from toppings.server.sched.step_budget import StepTimeModel

if TYPE_CHECKING:
    from toppings.server.sched.admission import GateLimits
    from toppings.server.sched.scheduler import StepPlan

WINDOW = 64  # steps of one kind between two corrections
MAX_CORRECTION_MS = 1000.0  # a window further off than this is a stall, not the model


@dataclass(frozen=True)
class StepShape:
    """What a step computed: its decode rows, and its prompt tokens in budget tokens
    (GateLimits.chunk_cost, so a late chunk counts its past)."""

    num_decodes: int
    prompt_cost: int


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
        steps = self._mixed if shape.prompt_cost else self._decode
        steps.append((shape, ms))
        if len(steps) < self.window:
            return None
        gap = statistics.median(ms - self._modelled(s) for s, ms in steps)
        steps.clear()
        if abs(gap) > MAX_CORRECTION_MS:
            return None
        if shape.prompt_cost:
            self.model = replace(self.model, mixed_fixed_ms=self.model.mixed_fixed_ms + gap)
        else:
            self.model = replace(self.model, decode_ms=self.model.decode_ms + gap)
        self.num_refits += 1
        return self.model

    def _modelled(self, shape: StepShape) -> float:
        return self.model.mixed_step_ms(shape.num_decodes, shape.prompt_cost)


def shape_of(plan: StepPlan, limits: GateLimits) -> StepShape:
    """The shape of `plan` before it runs (its requests' `num_prefilled` not yet advanced)."""
    if not plan.is_mixed:  # whole prompts, or decodes only
        if plan.is_prefill:
            return StepShape(0, sum(limits.chunk_cost(s.prompt_len, 0) for s in plan.seqs))
        return StepShape(len(plan.seqs), 0)
    decodes, cost = 0, 0
    for seq, n in zip(plan.seqs, plan.chunks):
        if seq.is_prefilled:
            decodes += 1
        else:
            cost += limits.chunk_cost(n, seq.num_prefilled)
    return StepShape(decodes, cost)
