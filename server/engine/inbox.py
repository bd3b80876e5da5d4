"""The engine thread's inbox: what other threads ask of the engine, taken between its steps.

Request state is the engine thread's alone, so the HTTP threads (submissions, aborts) and the
adapter resolver (a retired adapter's device rows) do not touch it: they put an item here and
the engine thread applies the items at the start of its next iteration, in the order they came.
One type per kind of item, so that what each means is read from its type, not from its shape.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass

from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.sequence import Sequence
from toppings.server.sched.scheduler import Scheduler


@dataclass(frozen=True)
class EndRequest:
    """A request the output processor ended (output_processor.py: its text reached a stop
    string, or failed): the engine finishes it, its KV and adapter reference given back."""

    seq: Sequence
    reason: str
    error: str | None = None


ABORT_ALL = object()  # every request queued or running ends with "abort" (a drain out of time)


class Inbox:
    """Items for the engine thread: submitted requests, aborts, retired adapters, requests the
    output processor ended."""

    def __init__(self, scheduler: Scheduler, forget: Callable[[AdapterRef], None]):
        """forget: what the engine does with a retired adapter (its device rows, its cached KV,
        the queue policy's record), on the engine thread."""
        self._scheduler = scheduler
        self._forget = forget
        self._items: queue.Queue = queue.Queue()

    def submit(self, seqs: list[Sequence]) -> None:
        """Requests submitted together: the engine picks them up in one iteration."""
        self._items.put(seqs)

    def abort(self, request_id: str) -> None:
        self._items.put(request_id)

    def abort_all(self) -> None:
        self._items.put(ABORT_ALL)

    def retired(self, ref: AdapterRef) -> None:
        """An adapter whose name and host side are gone: the rest goes on the engine thread."""
        self._items.put(ref)

    def end(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """The output processor ended a request (a stop string, its text failing)."""
        self._items.put(EndRequest(seq, reason, error))

    def wake(self) -> None:
        """Wake an engine thread waiting on an empty inbox (shutdown)."""
        self._items.put(None)

    def empty(self) -> bool:
        return self._items.empty()

    def drain(self, block: bool) -> None:
        """Apply every item waiting (block: wait up to half a second for the first)."""
        try:
            item = self._items.get(timeout=0.5) if block else self._items.get_nowait()
            while True:
                if isinstance(item, list):  # requests submitted together
                    for seq in item:
                        self._scheduler.add(seq)
                elif isinstance(item, str):
                    self._scheduler.abort(item)
                elif item is ABORT_ALL:
                    self._scheduler.abort_all()
                elif isinstance(item, AdapterRef):
                    self._forget(item)
                elif isinstance(item, EndRequest):
                    if item.seq.finished:  # ended meanwhile; its client saw the text's reason
                        self._scheduler.recount(item.seq, item.reason)
                    else:
                        self._scheduler.finish(item.seq, item.reason, error=item.error)
                item = self._items.get_nowait()
        except queue.Empty:
            pass
