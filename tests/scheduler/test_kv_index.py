"""The KV block index: batches applied in sequence order, a gap reported with the first
missing number, duplicates skipped, a loss accepted by forgetting the server, and the longest
prefix of a request's hashes per server and medium."""

from __future__ import annotations

import msgpack

from toppings.scheduler.kv_index.index import KVIndex
from toppings.server.kv_events.block_hash import prompt_hashes


def stored(hashes, medium="GPU", name=None):
    return ["BlockStored", hashes, None, [1] * (4 * len(hashes)), 4, None, medium, name]


def batch(*events) -> bytes:
    return msgpack.packb([0.0, list(events), 0])


def test_gap_is_reported_and_nothing_applied_until_it_is_filled():
    index = KVIndex()
    assert index.apply("s", 0, batch(stored([1, 2]))) is None
    assert index.apply("s", 2, batch(stored([3]))) == 1
    assert index.blocks("s").keys() == {1, 2}
    assert index.apply("s", 1, batch(["BlockRemoved", [2], "GPU"])) is None
    assert index.apply("s", 1, batch(stored([9]))) is None  # a duplicate: skipped
    assert index.apply("s", 2, batch(stored([3]))) is None
    assert index.blocks("s").keys() == {1, 3}


def test_skip_to_forgets_the_server_and_resumes_there():
    index = KVIndex()
    index.apply("s", 0, batch(stored([1])))
    index.skip_to("s", 5)
    assert index.blocks("s") == {}
    assert index.apply("s", 5, batch(stored([7]))) is None
    assert index.blocks("s").keys() == {7}


def test_longest_prefix_per_server_and_medium_and_cleared():
    index = KVIndex()
    hashes = prompt_hashes(list(range(12)), 4, "a")
    index.apply("s1", 0, batch(stored(hashes[:2])))
    index.apply("s2", 0, batch(stored(hashes[:1]), stored(hashes[1:], medium="CPU")))
    assert index.matches(hashes) == {"s1": 2, "s2": 3}
    assert index.longest_prefix("s2", hashes, medium="GPU") == 1
    assert index.longest_prefix("s1", prompt_hashes(list(range(12)), 4, "b")) == 0
    index.apply("s1", 1, batch(["AllBlocksCleared"]))
    assert index.longest_prefix("s1", hashes) == 0


def test_map_encoded_events_decode_too():
    index = KVIndex()
    event = {"type": "BlockStored", "block_hashes": [4], "parent_block_hash": None,
             "token_ids": [1, 2], "block_size": 2, "medium": "CPU"}  # fmt: skip
    index.apply("s", 0, batch(event))
    assert index.blocks("s") == {4: frozenset({"CPU"})}
