"""What the scheduler's drain waits on: its proxied requests in flight.

The drain itself (signals, `draining`, the wait, then `stop`) is server.http.drain's, shared
with `toppings-serve`: the first SIGTERM or SIGINT makes `/health` and new requests 503
(scheduler.app) while the requests in flight, streams included, run to their end, for at most
the drain timeout; the streams still running then end with an error event and `[DONE]`
(scheduler.server_session.LiveStreams); then waitress stops and the command stops its loops
and exits 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

POLL_S = 0.05
# What a client of a stream still running when the drain timeout passes reads last
DRAIN_ENDED = "the scheduler is shutting down: its --drain-timeout passed"


class InFlight(Protocol):
    """The front end's count of proxied requests whose answer has not ended."""

    @property
    def num_in_flight(self) -> int: ...


def in_flight_ended(in_flight: InFlight) -> Callable[[float], bool]:
    """A Drainer's `wait`: whether every request in flight ended within its timeout."""

    def wait(timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while in_flight.num_in_flight:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    return wait
