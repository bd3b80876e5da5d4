"""A reservation for the oldest waiting request, and who may start before it (EASY backfilling).

When the oldest waiting request does not fit, it gets a reservation: the decode step by which
the running requests will have freed enough memory for it (each frees its reservation after at
most its remaining max_new_tokens steps; earlier when it stops early), and what will be spare
then. A younger request may start before it only if that does not move the reservation: it ends
by then, or it fits in what the oldest will leave spare (EASY backfilling: Lifka, "The ANL/IBM
SP scheduling system", 1995; Mu'alem and Feitelson, IEEE TPDS 2001). So the oldest request waits
no longer than the requests running when it became oldest take to end, whatever arrives after
it, and the memory it is waiting for is not left idle meanwhile.

Units: memory in KV slots (tokens), time in decode steps. Pure arithmetic, no engine state.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Reservation:
    """The oldest waiting request's place: `steps` decode steps from now it fits; what it will
    leave of the memory and batch rows then is `spare_tokens` and `spare_rows` (spent as
    requests that outlast the reservation start now)."""

    steps: int
    spare_tokens: int
    spare_rows: int

    def allows(self, tokens: int, max_steps: int) -> bool:
        """Whether a request taking `tokens` for at most `max_steps` steps may start now
        without delaying the reservation: it ends by then, or it fits in the spare."""
        if max_steps <= self.steps:
            return True  # it has ended and given everything back by then
        return tokens <= self.spare_tokens and self.spare_rows >= 1

    def take(self, tokens: int, max_steps: int) -> None:
        """A request `allows` let in started: one that outlasts the reservation uses spare."""
        if max_steps > self.steps:
            self.spare_tokens -= tokens
            self.spare_rows -= 1


def reserve(
    need_tokens: int,
    free_tokens: int,
    free_rows: int,
    running: list[tuple[int, int]],
) -> Reservation:
    """The reservation of a request that needs `need_tokens` and one batch row.

    free_tokens, free_rows: what is free now; running: (steps left at most, tokens it gives
    back) per running request. When even the end of every running request leaves too little
    (memory counted elsewhere, such as adapters, is not in `running`), the reservation is at
    the last one's end with nothing spare: only requests that end by then may start.
    """
    tokens, rows, steps = free_tokens, free_rows, 0
    for left, give in sorted(running):
        if tokens >= need_tokens and rows >= 1:
            break
        tokens, rows, steps = tokens + give, rows + 1, max(left, 0)
    if tokens < need_tokens or rows < 1:
        return Reservation(steps, 0, 0)
    return Reservation(steps, tokens - need_tokens, rows - 1)
