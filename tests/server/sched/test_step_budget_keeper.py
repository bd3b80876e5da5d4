"""The budget keeper's log (server/sched/step_budget_keeper.py): an operator's INFO log gets the
budget's moves that change what a step does, not every refit's few tokens; DEBUG gets them all.
The steps are drawn from a known model: no timing."""

from __future__ import annotations

import logging
import random
from dataclasses import replace

from tests.server.sched.test_chunked_schedule import unfloored
from toppings.server.sched.step_budget import ITL_TARGET_MS, StepTimeModel
from toppings.server.sched.step_budget_keeper import StepBudgetKeeper
from toppings.server.sched.step_refit import StepShape, modelled_ms, scaled

# without a GEMM floor: the target sizes the steps of the batches drawn here
PRIOR = unfloored(StepTimeModel(ms_per_token=1.0, decode_ms=20.0, decode_ms_per_request=1.0))
LOGGER = "toppings.server.sched.step_budget_keeper"


def run_steps(keeper: StepBudgetKeeper, true: StepTimeModel, num_steps: int, seed: int) -> int:
    """Batches of 9-14 decodes (the target sizes their steps) with a few
    prompt tokens beside them, each step drawn from
    `true` give or take 10%; returns how often the keeper moved the budget."""
    rng, moves = random.Random(seed), 0
    for _ in range(num_steps):
        shape = StepShape(rng.randint(9, 14), rng.choice([0, 0, 8, 24, 40]), 0.0)
        ms = modelled_ms(true, shape) * rng.uniform(0.9, 1.1)
        moves += keeper.observe(shape, ms / 1000) is not None
    return moves


def keeper() -> StepBudgetKeeper:
    return StepBudgetKeeper(32, 8192, 0, ITL_TARGET_MS, measure=lambda: None, step_model=PRIOR)


def info_moves(caplog) -> list[str]:
    return [r.message for r in caplog.records if r.levelno == logging.INFO and "->" in r.message]


def test_small_moves_stay_at_debug(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    kept = keeper()
    moves = run_steps(kept, PRIOR, 400, seed=1)
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG and "->" in r.message]
    assert moves >= 10 and len(debug) + len(info_moves(caplog)) == moves
    # the batch of a few requests moves the budget by a few tokens each refit: 3 lines in 400 steps
    assert len(info_moves(caplog)) <= 4


def test_a_slower_machine_is_logged_at_info(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    kept = keeper()
    before = kept.budget.tokens
    run_steps(kept, scaled(PRIOR, 3.0), 200, seed=2)
    lines = info_moves(caplog)
    assert lines and kept.budget.tokens != before
    assert f"-> {kept.budget.tokens} tokens" in lines[-1] or kept.budget.tokens < before / 2


def test_a_step_far_over_the_stall_bound_is_named_at_debug(caplog):
    """A step streams waited on that took more than STALL_LOGGED x the stall bound (TILE_STALL
    x the target for a derived budget) gets a DEBUG line with its shape and the model's
    prediction; steps within it, and steps no stream waited on, get none."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    kept = keeper()
    bound = kept.budget.tile_stall * kept.budget.itl_target_ms
    within = StepShape(2, 40, 0.0)
    kept.observe(within, modelled_ms(PRIOR, within) / 1000)
    kept.observe(StepShape(0, 600, 0.0), 10 * bound / 1000)  # no stream waits on it
    assert not [r for r in caplog.records if "stall bound" in r.message]
    slow = StepShape(1, 480, 480 * 1500.0)
    kept.observe(slow, 3 * bound / 1000)
    (line,) = [r for r in caplog.records if "stall bound" in r.message]
    assert line.levelno == logging.DEBUG
    assert "1 decodes, 480 prompt tokens" in line.message and "3.0x the stall bound" in line.message
    assert f"modelled {modelled_ms(PRIOR, slow):.0f} ms" in line.message


def test_a_given_chunk_floor_sizes_every_batch_and_outlives_the_refits():
    """--chunk-floor-tokens in place of the model's floor (512, more beside more decodes): beside
    a few decodes, where the target allows fewer prompt tokens (a slow machine's model), a
    step's budget is the decodes plus the given floor; the refits keep it."""
    slow = replace(scaled(PRIOR, 40.0), gemm_floors=((0, 512), (20, 1024)))
    measured = StepBudgetKeeper(32, 8192, 0, ITL_TARGET_MS, lambda: None, slow)
    given = StepBudgetKeeper(32, 8192, 0, ITL_TARGET_MS, lambda: None, slow, 128)
    assert measured.budget.few_decodes[3] == 3 + 512
    assert given.budget.few_decodes[3] == 3 + 128 and given.budget.tokens == 32 + 128
    assert "chunks of at least 128 tokens" in given.budget.how and "1024" not in given.budget.how
    run_steps(given, scaled(PRIOR, 60.0), 200, seed=3)  # the budget now at the batch it runs
    few = given.budget.few_decodes
    assert len(few) > 8 and all(tokens == d + 128 for d, tokens in enumerate(few) if d)
