"""The prefix tree's bookkeeping and the eviction policies' order, without a model."""

from __future__ import annotations

import itertools
import random

import pytest

from toppings.gpu_lora.eviction import (
    Candidate,
    EvictionContext,
    ItemKind,
    expected_adapters,
    make_policy,
)
from toppings.server.memory.prefix_tree import KVNode, PrefixTree
from toppings.server.requests.adapter_ref import AdapterRef

BT = 4


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_match_is_per_adapter_and_by_whole_blocks():
    tree = PrefixTree(BT)
    created = tree.insert(tree.root("a"), tokens(10), [7, 8], now=1.0)  # 2 full blocks
    assert [n.block for n in created] == [7, 8] and tree.num_device == 2
    assert [n.block for n in tree.match("a", tokens(12), 5)] == [7, 8]
    assert [n.block for n in tree.match("a", tokens(7), 5)] == [7]  # the second is not whole
    assert tree.match("b", tokens(12), 5) == [] and tree.match(None, tokens(12), 5) == []
    assert [n.block for n in tree.match("a", tokens(12), 1)] == [7]  # capped
    other = tokens(4) + [99, 98, 97, 96]
    assert [n.block for n in tree.match("a", other, 5)] == [7]


def test_a_duplicate_block_ends_the_insertion():
    tree = PrefixTree(BT)
    tree.insert(tree.root("a"), tokens(8), [1, 2], now=0.0)
    again = tree.insert(tree.root("a"), tokens(8), [5, 6], now=0.0)
    assert again == [] and tree.num_device == 2


def test_pinned_counts_follow_references_and_the_creator():
    tree = PrefixTree(BT)
    first, second = tree.insert(tree.root("a"), tokens(8), [1, 2], now=0.0)
    assert tree.num_held == 2 and tree.num_pinned_unreserved == 0  # the creator reserves them
    tree.hold(first, now=1.0)  # a second request reuses the first block
    tree.unhold(first, created=True, now=2.0)  # the creator ends...
    tree.unhold(second, created=True, now=2.0)
    assert tree.num_pinned_unreserved == 1 and tree.num_held == 1  # ...the reuser holds one
    assert tree.device_leaves() == [second]  # the held block may not leave
    tree.unhold(first, created=False, now=3.0)
    assert tree.num_pinned_unreserved == 0 and tree.num_held == 0
    with pytest.raises(RuntimeError):
        tree.unhold(first, created=False, now=3.0)


def test_only_leaves_leave_and_an_adapter_root_goes_with_its_last_block():
    tree = PrefixTree(BT)
    first, second = tree.insert(tree.root("a"), tokens(8), [1, 2], now=0.0)
    for node in (first, second):
        tree.unhold(node, created=True, now=0.0)
    assert tree.has_device_kv("a") and tree.device_leaves() == [second]
    with pytest.raises(RuntimeError):
        tree.drop(first)  # it has a device child
    assert tree.to_host(second, host_block=0) == 2
    assert tree.device_leaves() == [first] and tree.host_nodes() == [second]
    assert tree.drop(first) == ([1], [0])  # its host subtree goes with it
    assert not tree.has_device_kv("a") and "a" not in tree.roots
    assert tree.num_device == 0 and tree.num_host == 0


def test_a_host_block_comes_back_held():
    tree = PrefixTree(BT)
    (node,) = tree.insert(tree.root(None), tokens(4), [3], now=0.0)
    tree.unhold(node, created=True, now=0.0)
    tree.to_host(node, host_block=5)
    path = tree.match(None, tokens(6), 1)
    assert path == [node] and not node.on_device
    tree.hold(node, now=1.0)
    assert tree.num_held == 0  # a host block takes no device memory
    assert tree.to_device(node, block=9) == 5
    assert tree.num_held == 1 and tree.num_pinned_unreserved == 1


def _context(**kw) -> EvictionContext:
    visits = {ItemKind.KV: 10, ItemKind.ADAPTER: 10}
    base = dict(now=100.0, visits_by_kind=visits, expected_adapters=1.0, cached_adapters=4)
    return EvictionContext(**{**base, **kw})


def test_fastlibra_keeps_recent_frequent_and_costly_items():
    policy = make_policy("fastlibra")
    old = Candidate(ItemKind.KV, "old", 1000, visits=5, last_used=90.0)
    recent = Candidate(ItemKind.KV, "recent", 1000, visits=5, last_used=99.9)
    rare = Candidate(ItemKind.KV, "rare", 1000, visits=1, last_used=99.9)
    big = Candidate(ItemKind.ADAPTER, "big", 50_000, visits=5, last_used=99.9)
    order = [c.item for c in policy.order([big, recent, rare, old], _context())]
    assert order == ["old", "rare", "recent", "big"]


def test_fastlibra_rewards_adapters_while_fewer_are_cached_than_batches_use():
    policy = make_policy("fastlibra")
    kv = Candidate(ItemKind.KV, "kv", 1000, visits=5, last_used=99.0)
    adapter = Candidate(ItemKind.ADAPTER, "ad", 1000, visits=5, last_used=99.0)
    few = policy.order([adapter, kv], _context(expected_adapters=8.0, cached_adapters=2))
    assert [c.item for c in few] == ["kv", "ad"]
    assert expected_adapters({"a": 1, "b": 1}, batch_size=1) == pytest.approx(1.0)
    assert expected_adapters({"a": 1, "b": 1}, batch_size=50) == pytest.approx(2.0)
    assert expected_adapters({}, batch_size=8) == 0.0


def test_lru_and_unknown_policy():
    policy = make_policy("lru")
    a = Candidate(ItemKind.KV, "a", 1, 100, last_used=5.0)
    b = Candidate(ItemKind.ADAPTER, "b", 1, 1, last_used=1.0)
    assert [c.item for c in policy.order([a, b], _context())] == ["b", "a"]
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("nope")


def test_a_new_registration_of_a_name_finds_none_of_the_old_ones_blocks():
    old, new = AdapterRef.new("x", 8, 100), AdapterRef.new("x", 8, 100)
    tree = PrefixTree(BT)
    (node,) = tree.insert(tree.root(old), tokens(4), [1], now=0.0)
    tree.unhold(node, created=True, now=0.0)
    assert tree.match(old, tokens(8), 5) == [node]
    assert tree.match(new, tokens(8), 5) == []  # the same name, another id
    assert tree.has_device_kv(old) and not tree.has_device_kv(new)
    assert tree.adapters_with_device_kv() == [old]


def test_an_emptied_adapter_root_is_made_again():
    tree = PrefixTree(BT)
    old_root = tree.root("a")
    (node,) = tree.insert(old_root, tokens(4), [1], now=0.0)
    tree.unhold(node, created=True, now=0.0)
    tree.drop(node)
    assert "a" not in tree.roots and tree.root("a") is not old_root


def _scanned_leaves(tree: PrefixTree) -> set[KVNode]:
    return {n for n in tree.nodes()
            if n.on_device and n.refcount == 0 and n.num_device_children == 0}  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
def test_the_kept_leaves_equal_a_full_scan_after_random_operations(seed):
    """Requests hold paths, grow them and end; leaves go to the host, come back, are dropped;
    an adapter's KV is forgotten. After every step the kept set is what a walk finds."""
    rng = random.Random(seed)
    tree = PrefixTree(BT)
    blocks, host_blocks = itertools.count(), itertools.count()
    requests: list[tuple[str | None, list[KVNode], int]] = []  # adapter, held path, num matched
    for _ in range(600):
        op = rng.choice(["admit", "admit", "grow", "grow", "end", "host", "back", "drop", "forget"])
        device = [n for n in tree.nodes() if n.on_device]
        if op == "admit":  # a new request holds a cached path (or nothing, at a root)
            adapter = rng.choice(["a", "b", None])
            mine = [n for n in device if n.adapter == adapter]
            path = []
            if mine and rng.random() < 0.7:
                node = rng.choice(mine)
                while node.parent is not None:
                    path.append(node)
                    node = node.parent
                path.reverse()
            for node in path:
                tree.hold(node, now=1.0)
            requests.append((adapter, path, len(path)))
        elif op == "grow" and requests:  # it computed more full blocks
            adapter, path, matched = rng.choice(requests)
            tail = path[-1] if path else tree.root(adapter)
            tokens = [rng.randrange(2) for _ in range(BT * rng.randint(1, 3))]
            new = tree.insert(tail, tokens, [next(blocks) for _ in range(len(tokens) // BT)], 2.0)
            path.extend(new)
        elif op == "end" and requests:
            adapter, path, matched = requests.pop(rng.randrange(len(requests)))
            for i, node in enumerate(path):
                tree.unhold(node, created=i >= matched, now=3.0)
        elif op == "host" and tree.device_leaves():
            tree.to_host(rng.choice(tree.device_leaves()), next(host_blocks))
        elif op == "back":
            host = [n for n in tree.nodes() if not n.on_device
                    and (n.parent.parent is None or n.parent.on_device)]  # fmt: skip
            if host:
                tree.to_device(rng.choice(host), next(blocks))
        elif op == "drop" and tree.device_leaves():
            tree.drop(rng.choice(tree.device_leaves()))
        elif op == "forget":
            adapter = rng.choice(["a", "b", None])
            if adapter in tree.roots and not any(a == adapter for a, _, _ in requests):
                for node in list(tree.roots[adapter].children.values()):
                    tree.drop_subtree(node)
        kept = tree.device_leaves()
        assert len(kept) == len(set(kept)) and set(kept) == _scanned_leaves(tree)
