"""The scheduler's drain on SIGTERM or SIGINT, as `toppings-serve` drains.

The first signal sets `draining`: `/health` turns 503 and a new request gets 503 with
Retry-After (scheduler.app), while the requests in flight, streams included, run to their end
through the waitress that keeps serving them, for at most `timeout_s`. Then `stop` closes
waitress, whose `run()` returns in the main thread, and the command stops its loops and exits
0. A second signal kills at once.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("toppings-scheduler")

POLL_S = 0.05


class InFlight(Protocol):
    """The front end's count of proxied requests whose answer has not ended."""

    @property
    def num_in_flight(self) -> int: ...


class Drainer:
    """Waits for the requests in flight once `draining` is set, then calls `stop`."""

    def __init__(
        self,
        draining: threading.Event,
        in_flight: InFlight,
        timeout_s: float,
        stop: Callable[[], None],
    ):
        """stop: ends serving (GuardedServer.stop); called once the drain is over."""
        self.draining = draining
        self.in_flight = in_flight
        self.timeout_s = timeout_s
        self.stop = stop

    def install_signals(self) -> None:
        """Make the first SIGTERM or SIGINT drain (call from the main thread)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)  # a second signal kills at once
        log.info("%s: draining (up to %.0f s)", signal.Signals(signum).name, self.timeout_s)
        self.begin()

    def begin(self) -> threading.Thread:
        """Refuse new requests from now on and drain in a thread of its own (returned)."""
        self.draining.set()
        thread = threading.Thread(target=self.run, name="drain", daemon=True)
        thread.start()
        return thread

    def run(self) -> bool:
        """Wait for the requests in flight, then stop; whether they all ended in time."""
        drained = self.wait()
        if not drained:
            log.warning("drain timed out after %.0f s; aborting what is left", self.timeout_s)
        self.stop()
        return drained

    def wait(self) -> bool:
        """Whether every request in flight ended within `timeout_s`."""
        deadline = time.monotonic() + self.timeout_s
        while self.in_flight.num_in_flight:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True
