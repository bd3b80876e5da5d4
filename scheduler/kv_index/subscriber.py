"""Feeds the index from one server's KV events over ZMQ: a SUB socket on its endpoint and a
DEALER on its replay endpoint (vLLM's transport; the server side is server/kv_events).

Frames are (topic, sequence number as 8 bytes big-endian, payload). A gap (a batch numbered
past the one expected, which is also how a subscriber that joins late starts) is filled by
asking the replay socket for everything from the first missing number: it answers with the
batches it keeps, then -1 as the end. Batches it no longer keeps are lost (`KVIndex.skip_to`;
the server answers such a request with a resync soon after, server/kv_events/zmq_sink.py).
With a replay endpoint, a subscriber asks for everything kept as soon as it starts, so that a
server that publishes nothing for a while (idle) is known at once.
"""

from __future__ import annotations

import logging
import threading

import zmq

from toppings.scheduler.kv_index.index import KVIndex

log = logging.getLogger(__name__)

POLL_MS = 100
REPLAY_TIMEOUT_MS = 5000


class KVEventSubscriber:
    """One server's events into `index` under the name `server`, on a thread of its own until
    `close`. endpoint / replay_endpoint: addresses to connect to (tcp://host:5557); topic: the
    server's topic prefix ("" takes every topic)."""

    def __init__(
        self,
        index: KVIndex,
        server: str,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
    ):
        self.index, self.server = index, server
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-sub-{server}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            if self._replay_endpoint is not None:
                self._replay(self.index.status(self.server)[0])
            while not self._stop.is_set():
                if not self._sub.poll(POLL_MS):
                    continue
                _, seq, payload = self._sub.recv_multipart()
                self._receive(int.from_bytes(seq, "big"), payload)
        finally:
            self._sub.close(linger=0)

    def _receive(self, seq: int, payload: bytes) -> None:
        missing = self.index.apply(self.server, seq, payload)
        if missing is None:
            return
        if self._replay_endpoint is not None:
            self._replay(missing)
        if self.index.apply(self.server, seq, payload) is not None:
            log.warning("KV events of %s: batches from %d lost", self.server, missing)
            self.index.skip_to(self.server, seq)
            self.index.apply(self.server, seq, payload)

    def _replay(self, start: int) -> None:
        """Apply the batches the server kept from `start` on (a socket per request: a reply
        that timed out cannot be taken for the next one's)."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self._replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while dealer.poll(REPLAY_TIMEOUT_MS):
                _, seq, payload = dealer.recv_multipart()
                seq_no = int.from_bytes(seq, "big", signed=True)
                if seq_no < 0:
                    return
                if self.index.apply(self.server, seq_no, payload) is not None:
                    self.index.skip_to(self.server, seq_no)  # the kept ones start later
                    self.index.apply(self.server, seq_no, payload)
            log.warning("KV events replay of %s: no answer", self.server)
        finally:
            dealer.close(linger=0)
