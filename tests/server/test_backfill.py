"""The reservation of a waiting request and who may start before it (server.backfill)."""

from __future__ import annotations

from toppings.server.backfill import Reservation, reserve


def test_the_reservation_is_the_first_end_that_frees_enough():
    # 30 free; running requests end in 50, 10 and 30 steps giving back 40, 20 and 60.
    r = reserve(
        need_tokens=100, free_tokens=30, free_rows=4, running=[(50, 40), (10, 20), (30, 60)]
    )
    assert (r.steps, r.spare_tokens, r.spare_rows) == (30, 10, 5)


def test_a_request_that_fits_now_but_was_refused_is_reserved_at_once():
    r = reserve(need_tokens=10, free_tokens=30, free_rows=1, running=[(5, 10)])
    assert (r.steps, r.spare_tokens, r.spare_rows) == (0, 20, 0)


def test_a_batch_row_is_part_of_the_need():
    # Memory is free but no row: the first request to end gives one back.
    r = reserve(need_tokens=10, free_tokens=100, free_rows=0, running=[(8, 5), (3, 5)])
    assert (r.steps, r.spare_tokens, r.spare_rows) == (3, 95, 0)


def test_not_enough_even_when_everything_ends_leaves_nothing_spare():
    r = reserve(need_tokens=500, free_tokens=30, free_rows=2, running=[(7, 40), (12, 40)])
    assert (r.steps, r.spare_tokens, r.spare_rows) == (12, 0, 0)


def test_a_request_that_ends_by_the_reservation_always_may_start():
    r = Reservation(steps=20, spare_tokens=0, spare_rows=0)
    assert r.allows(tokens=1000, max_steps=20)
    r.take(1000, 20)
    assert (r.spare_tokens, r.spare_rows) == (0, 0)


def test_requests_that_outlast_it_share_the_spare():
    r = Reservation(steps=20, spare_tokens=50, spare_rows=2)
    assert r.allows(30, 21)
    r.take(30, 21)
    assert not r.allows(30, 21)  # 20 spare left
    assert r.allows(20, 100)
    r.take(20, 100)
    assert not r.allows(0, 21)  # no spare row left
    assert r.allows(0, 20)
