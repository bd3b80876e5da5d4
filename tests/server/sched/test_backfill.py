"""Reservations of waiting requests and who may start before them (server.backfill)."""

from __future__ import annotations

from toppings.server.sched.backfill import Reservation, allows, reserve, take


def spans(reservations):
    return [(r.steps, r.spare_tokens, r.spare_rows) for r in reservations]


def test_a_reservation_is_the_first_end_that_frees_enough():
    # 30 free; running requests end in 50, 10 and 30 steps giving back 40, 20 and 60.
    running = [(50, 40), (10, 20), (30, 60)]
    assert spans(reserve([(100, 5)], 30, 4, running)) == [(30, 10, 5)]


def test_a_request_that_fits_now_but_was_refused_is_reserved_at_once():
    assert spans(reserve([(10, 5)], 30, 1, [(5, 10)])) == [(0, 20, 0)]


def test_a_batch_row_is_part_of_the_need():
    # Memory is free but no row: the first request to end gives one back.
    assert spans(reserve([(10, 5)], 100, 0, [(8, 5), (3, 5)])) == [(3, 95, 0)]


def test_not_enough_even_when_everything_ends_leaves_nothing_spare():
    assert spans(reserve([(500, 5)], 30, 2, [(7, 40), (12, 40)])) == [(12, 0, 0)]


def test_a_later_reservation_comes_after_the_memory_the_first_holds():
    # 0 free; one running request frees 100 in 10 steps. The first waiting request takes 60
    # of it from step 10 for 20 steps; the second (60) fits only when the first has ended.
    first, second = reserve([(60, 20), (60, 5)], 0, 8, [(10, 100)])
    assert (first.steps, first.spare_tokens) == (10, 40)
    assert (second.steps, second.spare_tokens) == (30, 40)
    # The spare counts the lowest point from then on: a small second one fits at step 10,
    # leaving 40 - 30 = 10 while the first runs.
    _, small = reserve([(60, 20), (30, 5)], 0, 8, [(10, 100)])
    assert (small.steps, small.spare_tokens) == (10, 10)


def test_a_request_that_ends_by_a_reservation_always_may_start():
    r = Reservation(steps=20, spare_tokens=0, spare_rows=0)
    assert allows([r], tokens=1000, max_steps=20)
    take([r], 1000, 20)
    assert (r.spare_tokens, r.spare_rows) == (0, 0)


def test_requests_that_outlast_a_reservation_share_its_spare():
    r = Reservation(steps=20, spare_tokens=50, spare_rows=2)
    assert allows([r], 30, 21)
    take([r], 30, 21)
    assert not allows([r], 30, 21)  # 20 spare left
    assert allows([r], 20, 100)
    take([r], 20, 100)
    assert not allows([r], 0, 21)  # no spare row left
    assert allows([r], 0, 20)


def test_every_reservation_must_allow_it():
    early = Reservation(steps=5, spare_tokens=100, spare_rows=4)
    late = Reservation(steps=50, spare_tokens=0, spare_rows=0)
    assert allows([early, late], 80, 40)  # outlasts the early one, within its spare
    assert not allows([early, late], 80, 60)  # outlasts the late one too, which has none
    take([early, late], 80, 40)
    assert (early.spare_tokens, late.spare_tokens) == (20, 0)
