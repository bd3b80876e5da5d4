"""The output processor: detokenizing, stop strings and streaming on a thread of their own.

vLLM v1's output processor. The engine thread keeps only each request's token-level state and,
for every new token and finish, makes a small `OutputRecord`
(server/requests/text_output.py); it `emit`s them here during a step and `flush`es them at the
step's end as one batch, so a step costs the engine thread one queue put, not a decode per
request. This thread applies the batches in order to each request's `TextOutput`, which turns
tokens into text, cuts it at a stop string and puts the outputs on the request's handle.

A stop string is found here, after the engine has gone on: `end_request` tells the engine
(through its inbox), which ends the request a step or a few later (its KV and adapter reference
given back then); the tokens it made meanwhile are dropped, and the final output goes out with the
engine's finish record. Every request's records come from the engine thread in order and are
applied on this one thread, so its outputs reach its handle in order and its final one once.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from toppings.server.requests.sequence import Sequence
from toppings.server.requests.text_output import OutputRecord

log = logging.getLogger(__name__)


class OutputProcessor:
    """The thread that applies the engine's output records; see the module docstring."""

    def __init__(self, end_request: Callable[[Sequence, str, str | None], None]):
        """end_request(seq, reason, error): called on this thread for a request the engine should
        end: its text reached a stop string ("stop") or failed ("error")."""
        self._end_request = end_request
        self._batch: list[OutputRecord] = []
        self._batch_lock = threading.Lock()  # emit and flush may come from two threads
        self._batches: queue.SimpleQueue[list[OutputRecord] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="outputs", daemon=True)
        self._thread.start()

    def emit(self, record: OutputRecord) -> None:
        """Add a record to the batch the next `flush` sends (the engine thread, mostly)."""
        with self._batch_lock:
            self._batch.append(record)

    def flush(self) -> None:
        """Send the records emitted so far to this thread (the end of an engine iteration)."""
        with self._batch_lock:
            batch, self._batch = self._batch, []
        if batch:
            self._batches.put(batch)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """Apply every record emitted so far, then stop the thread and join it."""
        self.flush()
        self._batches.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (batch := self._batches.get()) is not None:
            for record in batch:
                try:
                    if record.output.apply(record):
                        self._end_request(record.seq, "stop", None)
                except Exception as exc:  # one request's text failing ends that request only
                    log.exception("output of request %s failed", record.output.request_id)
                    if not record.output.finished:
                        record.output.fail(f"output error: {exc}")
                        self._end_request(record.seq, "error", f"output error: {exc}")
