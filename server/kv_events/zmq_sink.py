"""The ZMQ transport of vLLM's `ZmqEventPublisher`: a PUB socket and a ROUTER for replays.

Each batch goes out as three frames, (topic, sequence number as 8 bytes big-endian, payload).
The last `REPLAY_BATCHES` batches are kept: a consumer that sees a gap in the sequence numbers
(or starts late) sends the first number it wants, 8 bytes big-endian, to the replay socket
(a DEALER sends (b"", seq); a REQ just seq) and gets back every kept batch from there as
(b"", seq, payload) and then (b"", -1 as 8 signed bytes, b"") to mark the end. A batch older
than what is kept is gone: the sink calls `on_miss`, and the server's next cache change is
preceded by a resync (AllBlocksCleared, then every block it holds: recorder.py), after which
the consumer's index is exact again.

Both sockets bind (`tcp://*:5557`, `ipc://...`): a server publishes at a stable address and
routers connect to it. Used by the publisher thread only.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import zmq

REPLAY_BATCHES = 10_000
SEND_HWM = 100_000  # batches a slow subscriber may fall behind before PUB drops for it
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ZmqSink:
    """See the module docstring."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        on_miss: Callable[[], None] = lambda: None,
    ):
        """on_miss: called when a replay asks for a batch no longer kept."""
        self._on_miss = on_miss
        self._ctx = zmq.Context.instance()
        self._topic = topic.encode("utf-8")
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(SEND_HWM)
        self._pub.bind(endpoint)
        self._replay = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
        self._next = 0  # the next batch's number
        self._kept: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=REPLAY_BATCHES)

    def send(self, seq: int, payload: bytes) -> None:
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._kept.append((seq, payload))
        self._next = seq + 1

    def serve(self) -> None:
        """Answer the replay requests waiting now."""
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not (identity, b"", seq): nothing to answer
            client, _, start = frames
            first = int.from_bytes(start, "big")
            kept_from = self._kept[0][0] if self._kept else self._next
            if first < kept_from:
                self._on_miss()
            for seq, payload in self._kept:
                if seq >= first:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
