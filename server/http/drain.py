"""The drain on SIGTERM, SIGINT or SIGHUP, shared by `toppings-serve` and `toppings-scheduler`.

The first signal sets `draining` (the app answers 503 to new requests and `/health`), then, in
a thread of its own, `wait(timeout_s)` lets the requests in flight, streams included, run to
their end through the waitress that keeps serving them; when that time runs out, `abort` ends
what is left (the server ends each request with finish_reason "abort", so its client gets an
answer, a stream its last chunk and [DONE], rather than a cut connection); then `stop` closes
waitress, whose `run()` returns in the main thread. A second signal kills at once. Each process
says what it waits on: the server its engine (`Engine.drain`), the scheduler its in-flight count.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)
DRAIN_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Drainer:
    """Refuses new requests once `draining` is set, waits for those in flight, then stops.

    wait: blocks up to its argument in seconds; whether everything in flight ended;
    stop: ends serving (GuardedServer.stop), called once the wait is over;
    abort: ends what is still in flight when the wait ran out, before `stop` (None: nothing).
    """

    def __init__(
        self,
        draining: threading.Event,
        wait: Callable[[float], bool],
        timeout_s: float,
        stop: Callable[[], None],
        abort: Callable[[], None] | None = None,
    ):
        self.draining = draining
        self.wait = wait
        self.timeout_s = timeout_s
        self.stop = stop
        self.abort = abort

    def install_signals(self) -> None:
        """Make the first SIGTERM, SIGINT or SIGHUP drain (call from the main thread). SIGHUP
        (the terminal closed) killed the process at once, its requests lost."""
        for sig in DRAIN_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        for sig in DRAIN_SIGNALS:
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
        drained = self.wait(self.timeout_s)
        if not drained:
            log.warning("drain timed out after %.0f s; aborting what is left", self.timeout_s)
            if self.abort is not None:
                self.abort()
        self.stop()
        return drained
