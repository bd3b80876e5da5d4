"""The engine side of the events without an engine: a full queue drops changes (counted) and
the next change that finds room resyncs, so the stream applied to an index still ends equal to
the tree."""

from __future__ import annotations

import queue

from toppings.scheduler.kv_index.index import KVIndex, decode_batch
from toppings.server.kv_events.recorder import KVEventRecorder
from toppings.server.kv_events.schema import EventEncoding, encode_batch
from toppings.server.memory.prefix_tree import PrefixTree
from toppings.server.requests.adapter_ref import AdapterRef

BT = 4


def drain(recorder: KVEventRecorder) -> list[list]:
    items = []
    while True:
        try:
            items.append(recorder.queue.get_nowait())
        except queue.Empty:
            return items


def index_of(items: list[list]) -> dict[int, frozenset[str]]:
    index = KVIndex()
    for seq, events in enumerate(items):
        assert index.apply("s", seq, encode_batch(0.0, events, 0, EventEncoding.ARRAY)) is None
    return index.blocks("s")


def tree_view(tree: PrefixTree) -> dict[int, frozenset[str]]:
    return {n.block_hash: frozenset({"GPU" if n.on_device else "CPU"}) for n in tree.nodes()}


def make_tree(max_queued: int) -> tuple[PrefixTree, KVEventRecorder]:
    tree: PrefixTree | None = None
    recorder = KVEventRecorder(BT, lambda: tree.nodes(), max_queued=max_queued)
    tree = PrefixTree(BT, recorder)
    return tree, recorder


def test_a_full_queue_drops_then_resyncs_to_the_tree():
    tree, recorder = make_tree(max_queued=3)
    adapter = AdapterRef.new("x", 4, 100)
    items = []
    for i in range(6):  # each insert a change; only 3 fit before the queue is drained
        tokens = [i] * (2 * BT)
        nodes = tree.insert(tree.root(adapter if i % 2 else None), tokens, [2 * i, 2 * i + 1], 0)
        for node in nodes:
            tree.unhold(node, True, 0)
    assert recorder.num_dropped == 3
    items += drain(recorder)
    assert index_of(items) != tree_view(tree)  # the drops lost blocks
    leaf = tree.device_leaves()[0]
    tree.drop(leaf)  # the next change finds room: a resync first, then the removal
    items += drain(recorder)
    tags = [t for item in items[3:] for t, _ in decode_batch(encode_batch(0.0, item, 0,
            EventEncoding.ARRAY))]  # fmt: skip
    assert tags[0] == "AllBlocksCleared"
    assert index_of(items) == tree_view(tree)


def test_swaps_move_a_block_between_media():
    tree, recorder = make_tree(max_queued=100)
    (node,) = tree.insert(tree.root(None), list(range(BT)), [0], 0)
    tree.unhold(node, True, 0)
    tree.to_host(node, 5)
    assert index_of(drain(recorder)) == {node.block_hash: frozenset({"CPU"})}
    tree.to_device(node, 1)
    tree.drop(node)
    assert index_of(drain(recorder)) == {}
