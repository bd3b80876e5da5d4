"""The publisher thread: batches what the recorder queued, numbers and encodes each batch, and
hands it to a sink (ZMQ on the operator's endpoint, zmq_sink.py; a list in tests).

Each round takes the changes queued since the last one (up to `MAX_BATCH_CHANGES`) into one
`KVEventBatch` stamped with the time it was sent; sequence numbers count batches from 0, one
per publisher (one per server process). The engine thread only ever enqueues (recorder.py).
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from typing import Protocol

from toppings.server.kv_events.recorder import KVEventRecorder
from toppings.server.kv_events.schema import Event, EventEncoding, encode_batch

log = logging.getLogger(__name__)

MAX_BATCH_CHANGES = 1024  # queued changes merged into one batch at most
IDLE_S = 0.05  # how long the thread waits for a change before serving the sink (replays)


class Sink(Protocol):
    """Where numbered, encoded batches go."""

    def send(self, seq: int, payload: bytes) -> None: ...

    def serve(self) -> None:
        """Work between batches (answer replay requests); must not block."""

    def close(self) -> None: ...


class KVEventPublisher:
    """See the module docstring. Started at construction; `close` sends what is queued."""

    def __init__(
        self,
        recorder: KVEventRecorder,
        sink: Sink,
        encoding: EventEncoding = EventEncoding.ARRAY,
        data_parallel_rank: int = 0,
    ):
        self.recorder, self.sink, self.encoding = recorder, sink, encoding
        self.data_parallel_rank = data_parallel_rank
        self.num_batches = 0  # the next batch's sequence number
        # Names this publisher's numbering (a restarted server numbers from 0 again): /stats
        # shows it, so that a consumer that sees it change forgets the old stream.
        self.stream_id = secrets.token_hex(8)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def describe(self) -> dict:
        """The stream's identity and counts for /stats (stats_schema KV_EVENTS, with the
        addresses added by the caller)."""
        return {"stream": self.stream_id, "batches": self.num_batches,
                "dropped": self.recorder.num_dropped}  # fmt: skip

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every change queued before this call is sent (not on the engine thread:
        it blocks while the queue is full). False if the thread did not get there in time."""
        done = threading.Event()
        self.recorder.queue.put(done, timeout=timeout_s)
        return done.wait(timeout_s)

    def close(self) -> None:
        """Send what is queued, stop the thread and close the sink."""
        self.recorder.queue.put(None)
        self._thread.join()
        self.sink.close()

    def _run(self) -> None:
        q = self.recorder.queue
        while True:
            try:
                items = [q.get(timeout=IDLE_S)]
            except queue.Empty:
                self._serve()
                continue
            while len(items) < MAX_BATCH_CHANGES and items[-1] is not None:
                try:
                    items.append(q.get_nowait())
                except queue.Empty:
                    break
            events = [e for item in items if isinstance(item, list) for e in item]
            if events:
                self._send(events)
            for item in items:
                if isinstance(item, threading.Event):
                    item.set()  # a flush: everything queued before it is sent
            self._serve()
            if items[-1] is None:
                return

    def _send(self, events: list[Event]) -> None:
        payload = encode_batch(time.time(), events, self.data_parallel_rank, self.encoding)
        try:
            self.sink.send(self.num_batches, payload)
        except Exception:  # a broken sink must not end the thread the flushes wait on
            log.exception("KV events batch %d not sent", self.num_batches)
        self.num_batches += 1

    def _serve(self) -> None:
        try:
            self.sink.serve()
        except Exception:
            log.exception("KV events sink failed between batches")
