"""A long prompt's chunks in whole tiles of the blocked attention kernel (server/sched/tiles.py):
the scheduler's numbers are the kernel's, a chunk cut below a tile after a long past is raised
to one within the stall bound, and a last partial tile of a few tokens is left to the next
step."""

from __future__ import annotations

from tests.server.sched.test_chunked_schedule import make_chunked, step, tokens_of
from tests.server.sched.test_scheduler import submit
from toppings.server.model import attention
from toppings.server.sched.step_budget import StepTimeModel, choose_step_budget
from toppings.server.sched.tiles import (
    ATTENTION_TILE,
    TILE_MIN_WORK,
    TILE_STALL,
    key_reads,
    runs_tiled,
    whole_tiles,
)


def test_the_schedulers_tile_is_the_kernels():
    assert (ATTENTION_TILE, TILE_MIN_WORK) == (attention.TILE_MIN_LEN, attention.TILE_MIN_WORK)


def test_the_keys_a_chunk_reads():
    # rows: each token its past and the chunk's tokens before it
    assert key_reads(20, 100) == 20 * (100 + 19 / 2)
    # whole tiles read what rows would; a partial tile reads as a whole one
    assert key_reads(64, 1000) == 64 * (1000 + 63 / 2)
    assert key_reads(40, 1000) == key_reads(64, 1000)


def test_a_last_partial_tile_of_a_few_tokens_waits_for_the_next_step():
    assert whole_tiles(70, 1000, 500) == 64  # 6 tokens would read the past once more
    assert whole_tiles(90, 1000, 500) == 90  # 26: most of a tile, worth its read
    assert whole_tiles(70, 1000, 70) == 70  # the prompt's last chunk: all of it
    assert whole_tiles(40, 0, 500) == 40  # the rows kernel's (a short past): no tiles
    assert runs_tiled(32, 1000) and not runs_tiled(32, 100) and not runs_tiled(31, 10_000)


def test_a_chunk_is_raised_to_a_tile_only_within_the_stall_bound():
    """A budget of 40 beside 4 decodes, a past weight of 0.002: after 1,000 tokens the budget
    leaves a chunk 11 tokens, a tile costs 32 x 3.03 = 97 budget tokens: 101 > 2 x 40 stays
    11 (rows); with a weight of 0.001 the budget leaves 17, a tile costs 65: 69 <= 80 is raised
    to a tile."""
    for weight, want in ((0.002, 11), (0.001, ATTENTION_TILE)):
        sched, _, _ = make_chunked(
            budget=40, max_batch=8, past_weight=weight, tile_stall=TILE_STALL
        )
        streams = [submit(sched, prompt_len=4, max_new=400, ignore_eos=True) for _ in range(4)]
        step(sched)
        long = submit(sched, prompt_len=3000, max_new=1, ignore_eos=True)
        while long.num_prefilled < 1000:
            step(sched)
        past = long.num_prefilled
        got = tokens_of(step(sched))
        limits = sched.limits
        assert all(got[s] == 1 for s in streams)
        assert limits.chunk_within(36, past) < ATTENTION_TILE
        cost = 4 + limits.chunk_cost(got[long], past)
        assert got[long] == want and cost <= TILE_STALL * 40
        if want == ATTENTION_TILE:
            assert 4 + limits.chunk_cost(ATTENTION_TILE, past) > 40  # over the budget itself


def test_a_budget_the_operator_bounded_is_not_exceeded_for_a_tile():
    """--max-num-batched-tokens: the budget is the stall bound itself, so the chunk the budget
    leaves (17 tokens, a tile would cost 69 of 40) stays on the rows kernel; a budget derived
    from the inter-token target, the default one or a given one, allows the tile
    (TILE_STALL)."""
    given = choose_step_budget(32, 8192, max_num_batched_tokens=40)
    assert given.tile_stall == 1.0
    target = choose_step_budget(32, 8192, itl_target_ms=200.0, model=StepTimeModel())
    assert target.tile_stall == TILE_STALL
    assert choose_step_budget(32, 8192, model=StepTimeModel()).tile_stall == TILE_STALL
    sched, _, _ = make_chunked(budget=40, max_batch=8, past_weight=0.001)
    assert sched.limits.tile_stall == 1.0
    for _ in range(4):
        submit(sched, prompt_len=4, max_new=400, ignore_eos=True)
    step(sched)
    long = submit(sched, prompt_len=3000, max_new=1, ignore_eos=True)
    while long.num_prefilled < 1000:
        step(sched)
    got = tokens_of(step(sched))
    assert got[long] == 17 and 4 + sched.limits.chunk_cost(17, long.num_prefilled - 17) <= 40
