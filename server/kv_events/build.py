"""Starts the KV events of a server from its memory settings: the recorder the prefix tree
announces its changes to, and the publisher thread that sends them (zmq_sink.py on
`--kv-events-endpoint`, or a sink given in-process)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from toppings.server.config import MemoryConfig
from toppings.server.kv_events.publisher import KVEventPublisher, Sink
from toppings.server.kv_events.recorder import Block, KVEventRecorder
from toppings.server.kv_events.schema import EventEncoding
from toppings.server.kv_events.zmq_sink import ZmqSink


def start_kv_events(
    memory: MemoryConfig,
    block_size: int,
    snapshot: Callable[[], Iterable[Block]],
    sink: Sink | None = None,
) -> KVEventPublisher | None:
    """The running publisher (its recorder is `.recorder`), having announced AllBlocksCleared
    first so that consumers forget an earlier process on the same endpoint; None when events
    are off (no endpoint, no sink, or no prefix cache). snapshot: every block of the tree, for
    a resync; sink: where batches go instead of the configured endpoint (tests)."""
    if not memory.prefix_cache or (sink is None and not memory.kv_events_endpoint):
        return None
    recorder = KVEventRecorder(block_size, snapshot)
    if sink is None:
        sink = ZmqSink(
            memory.kv_events_endpoint,
            memory.kv_events_replay_endpoint,
            memory.kv_events_topic,
            on_miss=recorder.request_resync,
        )
    recorder.reset()
    return KVEventPublisher(recorder, sink, EventEncoding(memory.kv_events_encoding))
