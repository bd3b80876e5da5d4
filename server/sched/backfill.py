"""Reservations for waiting requests, and who may start before them (backfilling).

A waiting request that does not fit gets a reservation: the decode step from which the memory
will stay free enough for it (each running request frees its memory after at most its remaining
max_new_tokens steps, earlier when it stops early; a request reserved before it holds its memory
from its own reservation until it may have ended), and what will be spare from then on. A younger
request may start before the reserved ones only if that moves none of their reservations: it ends
by each one's step, or fits in what each leaves spare (EASY backfilling, with a few reservations
instead of one: Lifka, "The ANL/IBM SP scheduling system", 1995; Mu'alem and Feitelson, IEEE TPDS
2001). So a reserved request waits no longer than the requests running or reserved before it take
to end, whatever arrives after it, and the memory it waits for is not left idle meanwhile.

Units: memory in KV slots (tokens), time in decode steps. Pure arithmetic, no engine state.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Reservation:
    """From `steps` decode steps on, the request fits, leaving at least `spare_tokens` and
    `spare_rows` (spent as requests that outlast `steps` start now)."""

    steps: int
    spare_tokens: int
    spare_rows: int


@dataclass
class Reservations:
    """The waiting requests that hold a reservation, in the order they were made, and theirs."""

    holders: list
    spans: list[Reservation]

    def ahead_of(self, request: object) -> list[Reservation]:
        """The reservations `request` must not delay: all, or those made before its own."""
        for i, holder in enumerate(self.holders):
            if holder is request:
                return self.spans[:i]
        return self.spans


def allows(reservations: list[Reservation], tokens: int, max_steps: int) -> bool:
    """Whether a request taking `tokens` for at most `max_steps` steps may start now without
    delaying any reservation: by each one's step it has ended, or it fits in the spare."""
    return all(
        max_steps <= r.steps or (tokens <= r.spare_tokens and r.spare_rows >= 1)
        for r in reservations
    )


def take(reservations: list[Reservation], tokens: int, max_steps: int) -> None:
    """A request `allows` let in started: it uses the spare of each reservation it outlasts."""
    for r in reservations:
        if max_steps > r.steps:
            r.spare_tokens -= tokens
            r.spare_rows -= 1


def reserve(
    waiting: list[tuple[int, int]],
    free_tokens: int,
    free_rows: int,
    running: list[tuple[int, int]],
) -> list[Reservation]:
    """Reservations for `waiting`, in priority order: (tokens it needs, its max steps) each,
    plus one batch row.

    free_tokens, free_rows: what is free now; running: (steps left at most, tokens it gives
    back) per running request. Memory counted elsewhere (adapters, shared prefixes) is not in
    `running`: when what it lists never frees enough, the reservation is at the last change
    with nothing spare, so that only requests ending by then may start.
    """
    changes = [(max(left, 0), give, 1) for left, give in running]  # (step, tokens, rows) freed
    reservations = []
    for need, max_steps in waiting:
        at, tokens, rows = _first_fit(changes, free_tokens, free_rows, need)
        reservations.append(Reservation(at, tokens - need, rows - 1))
        changes += [(at, -need, -1), (at + max(max_steps, 0), need, 1)]
    return reservations


def _first_fit(
    changes: list[tuple[int, int, int]], free_tokens: int, free_rows: int, need: int
) -> tuple[int, int, int]:
    """The first step from which the free memory and rows never fall below (need, 1), and the
    least free from then on; (last step, need, 1) when there is none."""
    steps = sorted({0, *(s for s, _, _ in changes)})
    profile, tokens, rows = [], free_tokens, free_rows
    for step in steps:  # what is free from `step` until the next change
        tokens += sum(t for s, t, _ in changes if s == step)
        rows += sum(r for s, _, r in changes if s == step)
        profile.append((step, tokens, rows))
    least_tokens, least_rows = profile[-1][1], profile[-1][2]
    found = None
    for step, tokens, rows in reversed(profile):
        least_tokens, least_rows = min(least_tokens, tokens), min(least_rows, rows)
        if least_tokens < need or least_rows < 1:
            break
        found = (step, least_tokens, least_rows)
    return found or (steps[-1], need, 1)
