"""A consumer that joins after the replay socket dropped the first batches: its replay request
asks the server for a resync, and the server's next cache change brings it, after which the
consumer's index is exact and equal to the tree (over ZMQ, no engine)."""

from __future__ import annotations

import time

from toppings.scheduler.kv_index.index import KVIndex
from toppings.scheduler.kv_index.subscriber import KVEventSubscriber
from toppings.server.kv_events import zmq_sink
from toppings.server.kv_events.publisher import KVEventPublisher
from toppings.server.kv_events.recorder import KVEventRecorder
from toppings.server.memory.prefix_tree import PrefixTree

BT = 4


def test_a_late_consumer_gets_a_resync_and_ends_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(zmq_sink, "REPLAY_BATCHES", 2)
    tree: PrefixTree | None = None
    recorder = KVEventRecorder(BT, lambda: tree.nodes())
    tree = PrefixTree(BT, recorder)
    endpoint, replay = f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/kv-replay.sock"
    sink = zmq_sink.ZmqSink(endpoint, replay, "kv", on_miss=recorder.request_resync)
    recorder.reset()
    publisher = KVEventPublisher(recorder, sink)
    block = 0

    def change(i: int) -> None:
        nonlocal block
        for node in tree.insert(tree.root(None), [i] * (2 * BT), [block, block + 1], 0):
            tree.unhold(node, True, 0)
        block += 2
        assert publisher.flush()

    index = KVIndex()
    subscriber = None
    try:
        for i in range(5):  # batches 0..5: the replay keeps the last two
            change(i)
        subscriber = KVEventSubscriber(index, "s", endpoint, replay, topic="kv")
        deadline = time.monotonic() + 30
        while not index.status("s")[1] or index.blocks("s").keys() != {
            n.block_hash for n in tree.nodes()
        }:
            assert time.monotonic() < deadline, "no resync reached the late consumer"
            change(100 + block)  # each change may carry the resync asked for
            time.sleep(0.05)
        assert recorder.num_resyncs_asked >= 1
        assert recorder.num_dropped == 0
    finally:
        if subscriber is not None:
            subscriber.close()
        publisher.close()
