"""Chunked prefill's step budget over an engine's life: chosen at start-up, kept true to the
steps the engine really runs.

At start-up the budget comes from `--max-num-batched-tokens` when given, else from a step-time
model (one a benchmark passes, or one fitted to step times the engine measures on its own model
and machine, its GEMM floor replaced by `--chunk-floor-tokens` where that is given) and the
inter-token target (server.sched.step_budget). A derived budget then
follows the steps as they run: the engine hands each step's shape and seconds to `observe`,
which corrects the model (server.sched.step_refit) and, when that moves the budget, returns the
new one for the scheduler. The budget is logged at INFO when it moves by a quarter (and by
`MIN_CHUNK` tokens) since it was last logged there; every move is logged at DEBUG. So is a step
that streams waited on and that took more than `STALL_LOGGED` times the stall bound (the most a
step with decodes is planned to take: `StepBudget.tile_stall` times the inter-token target),
with its shape, what the model said it would take and the budget it was planned with: the
line that names a stall in a benchmark's log (off by default).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from toppings.server.sched.step_budget import (
    MIN_CHUNK,
    StepBudget,
    StepPoints,
    StepTimeModel,
    choose_step_budget,
)
from toppings.server.sched.step_refit import StepRefit, StepShape, modelled_ms, shape_of

if TYPE_CHECKING:
    from toppings.server.sched.plan import StepPlan

log = logging.getLogger(__name__)

LOGGED_MOVE = 0.25  # a move of the budget this fraction of its last logged value goes to INFO
STALL_LOGGED = 1.5  # a step this many times the stall bound goes to DEBUG with its shape


class StepBudgetKeeper:
    """One engine's chunked-prefill budget; see the module docstring."""

    def __init__(
        self,
        max_batch_size: int,
        max_prefill_tokens: int,
        max_num_batched_tokens: int,
        itl_target_ms: float,
        measure: Callable[[], StepPoints | None],
        step_model: StepTimeModel | None = None,
        chunk_floor_tokens: int = 0,
        scored_weight: float = 0.0,
    ):
        """measure: () -> step times measured on the engine's model (None: none could be);
        asked only when neither `max_num_batched_tokens` nor `step_model` is given.
        chunk_floor_tokens: the GEMM floor at every number of decodes in place of the model's
        (`--chunk-floor-tokens`; 0: the model's). scored_weight: StepBudget.scored_weight."""
        self.max_batch_size, self.max_prefill_tokens = max_batch_size, max_prefill_tokens
        self.max_num_batched_tokens, self.itl_target_ms = max_num_batched_tokens, itl_target_ms
        self.step_model, self.scored_weight = step_model, scored_weight
        if self.step_model is None and not max_num_batched_tokens:
            times = measure()
            self.step_model = StepTimeModel.fit(times) if times is not None else StepTimeModel()
        if self.step_model is not None and chunk_floor_tokens:
            self.step_model = replace(self.step_model, gemm_floors=((0, chunk_floor_tokens),))
        self.budget = self._budget_of(self.step_model)
        log.info("chunked prefill: %s.", self.budget.how)
        if self.step_model is not None:
            log.debug("chunked prefill's step model: %s", self.step_model.source)
        # A derived budget follows the steps as they really run (a given one stays).
        self._refit = StepRefit(self.step_model) if not max_num_batched_tokens else None
        self._logged = self.budget  # the budget last logged at INFO
        self._faults = 0  # refits that raised

    @property
    def follows_steps(self) -> bool:
        """Whether `observe` wants the steps (a derived budget)."""
        return self._refit is not None

    def _budget_of(self, model: StepTimeModel | None) -> StepBudget:
        return choose_step_budget(
            self.max_batch_size, self.max_prefill_tokens,
            self.max_num_batched_tokens, self.itl_target_ms, model, self.scored_weight,
        )  # fmt: skip

    def shape_of(self, plan: StepPlan) -> StepShape | None:
        """What `observe` needs of a plan, taken before the step runs (it moves the plan's
        requests on); None when the budget does not follow the steps."""
        return shape_of(plan, self.scored_weight) if self._refit is not None else None

    def observe(self, shape: StepShape, seconds: float) -> StepBudget | None:
        """Correct the step model by the step just run (server.sched.step_refit); returns the
        new budget when that moves it (the scheduler's from the next step on), else None. A
        fault of the refit is logged and keeps the budget as it was: the engine goes on
        serving (tests/server/engine/test_budget_fault.py)."""
        try:
            return self._follow(shape, seconds)
        except Exception:
            self._faults += 1
            if self._faults in (1, 10, 100) or not self._faults % 1000:
                log.exception("the step budget's refit failed (%d times); the budget stays as "
                              "it was", self._faults)  # fmt: skip
            return None

    def _follow(self, shape: StepShape, seconds: float) -> StepBudget | None:
        if self._refit is None:
            return None
        if shape.num_decodes and log.isEnabledFor(logging.DEBUG):
            self._log_stall(shape, 1000 * seconds)
        model = self._refit.observe(shape, 1000 * seconds)
        if model is None:
            return None
        self.step_model, before = model, self.budget
        self.budget = budget = self._budget_of(model)
        if replace(budget, how=before.how) == before:  # every field but its log line's words
            return None
        batch = model.batch_size or self.max_batch_size  # the batch the engine runs now
        # every window moves it a little, and at budgets of a few dozen tokens by a tenth: an
        # operator's log gets the moves that change what a step does. Compared at the batch the
        # engine runs now: a batch that crosses to another floor changes the one number, not a step
        was = steps_of(self._logged, batch)
        moved = abs(budget.tokens - was) >= max(was * LOGGED_MOVE, MIN_CHUNK)
        if moved:
            self._logged = budget
        log.log(
            logging.INFO if moved else logging.DEBUG,
            "chunked prefill: %d -> %d tokens a step beside %d decodes (real steps: %.0f ms "
            "beside no prompt, a prompt token %.2g ms more)",
            was, budget.tokens, batch, model.decode_step_ms(batch), model.ms_per_token,
        )  # fmt: skip
        return budget

    def _log_stall(self, shape: StepShape, ms: float) -> None:
        """A DEBUG line for a step streams waited on that took over STALL_LOGGED x the stall
        bound (the budget and model it was planned with: observe has not refitted yet)."""
        budget, model = self.budget, self.step_model
        bound = budget.tile_stall * budget.itl_target_ms
        if model is None or not bound or ms <= STALL_LOGGED * bound:
            return
        tokens = steps_of(budget, shape.num_decodes)
        log.debug(
            "a step streams waited on took %.0f ms, %.1fx the stall bound (%.0f ms: %g x the "
            "%.0f ms target): %d decodes, %d prompt tokens scored against %.0f keys of past; "
            "modelled %.0f ms, planned within %d budget tokens (a prompt token after a past of P "
            "counts 1 + %.2g x P)",
            ms, ms / bound, bound, budget.tile_stall, budget.itl_target_ms, shape.num_decodes,
            shape.prompt_tokens, shape.past_work, modelled_ms(model, shape), tokens,
            budget.past_weight,
        )  # fmt: skip


def steps_of(budget: StepBudget, num_decodes: int) -> int:
    """The budget of a step of `num_decodes` decodes under `budget` (GateLimits.step_tokens)."""
    few = budget.few_decodes
    return few[num_decodes] if num_decodes < len(few) else budget.tokens
