"""Cached KV prefixes per adapter: the dependency tree of ELORA/FastLibra.

root -> one node per adapter (None: the base model) -> one node per full KV block of a token
prefix. A request reuses the longest chain of blocks under its own adapter whose tokens equal
its prompt's, so a prefix computed under one adapter is never used under another (an activated
LoRA's blocks before its activation are base-model KV: the memory manager keys them under None,
server/memory/manager.py `tree_key`). Adapters are keyed by `AdapterRef`, that is by id: an
adapter loaded again under an earlier one's name never finds the earlier one's KV. Bookkeeping
only: which block (device) or host block holds a node; the memory manager moves the bytes.

Rules that keep the tree valid:
- a request that holds a node holds its whole path (it matched or created it from the root), so
  a node with a reference has referenced ancestors, and a node without one has none below it;
- only leaves leave the device: a device node with device children stays (a node may keep host
  children), and an adapter is evicted only when no device KV depends on it;
- a host node's children are on the host too; a node comes back only under a device parent.

The evictable leaves (device nodes without a reference or device children) are kept in a set
updated wherever a node is inserted, held, released, moved or removed, so a reclaim round finds
them without walking the tree.

With a KV event recorder (server/kv_events), each node carries the hash it is announced under
(chained from its parent's, salted by its adapter's name: kv_events/block_hash.py) and every
change is announced: blocks inserted (BlockStored), moved between the device and the host tier
(BlockRemoved from one medium, BlockStored in the other) and dropped (BlockRemoved). An
activated LoRA's blocks before its activation sit under the base model's root, so they hash and
are announced as the base model's.

`num_pinned_unreserved` counts device nodes that running requests hold and whose creator has
ended: blocks the admission budget must count apart from the requests' own reservations.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from toppings.server.kv_events.block_hash import block_hash
from toppings.server.kv_events.recorder import KVEventRecorder
from toppings.server.kv_events.schema import MEDIUM_DEVICE, MEDIUM_HOST
from toppings.server.requests.adapter_ref import AdapterRef


@dataclass(eq=False)
class KVNode:
    """One full block of a prefix (or, at depth 0, an adapter's root)."""

    key: tuple[int, ...]  # the block's token ids; () for an adapter root
    adapter: AdapterRef | None
    parent: KVNode | None
    depth: int  # blocks from the adapter root (the root is 0)
    block: int | None = None  # device block; None while on the host (or for a root)
    host_block: int | None = None
    block_hash: int | None = None  # announced under (None: a root, or no events)
    children: dict[tuple[int, ...], KVNode] = field(default_factory=dict)
    num_device_children: int = 0
    refcount: int = 0
    creator_active: bool = False  # the request that computed it still runs and reserves it
    visits: int = 0
    last_used: float = 0.0

    @property
    def on_device(self) -> bool:
        return self.block is not None

    @property
    def pinned_unreserved(self) -> bool:
        return self.on_device and self.refcount > 0 and not self.creator_active

    @property
    def is_evictable_leaf(self) -> bool:
        """A KV node (not a root) on the device, unreferenced, without device children."""
        return (
            self.parent is not None
            and self.on_device
            and self.refcount == 0
            and self.num_device_children == 0
        )


class PrefixTree:
    """See the module docstring. `block_tokens` tokens per node; events: where changes are
    announced (None: nowhere, and nodes are not hashed)."""

    def __init__(self, block_tokens: int, events: KVEventRecorder | None = None):
        self.block_tokens = block_tokens
        self.events = events
        self.roots: dict[AdapterRef | None, KVNode] = {}
        self.num_device = 0  # device KV nodes
        self.num_host = 0
        self.num_pinned_unreserved = 0
        self.num_held = 0  # device KV nodes with a reference
        self._leaves: dict[KVNode, None] = {}  # the evictable leaves (ordered set)

    def _chunks(self, tokens: list[int], num_blocks: int):
        bt = self.block_tokens
        return (tuple(tokens[i * bt : (i + 1) * bt]) for i in range(num_blocks))

    def root(self, adapter: AdapterRef | None) -> KVNode:
        node = self.roots.get(adapter)
        if node is None:
            node = self.roots[adapter] = KVNode((), adapter, None, 0)
        return node

    def match(self, adapter: AdapterRef | None, tokens: list[int], max_blocks: int) -> list[KVNode]:
        """The longest chain of cached blocks (device or host) equal to tokens' prefix."""
        node, path = self.roots.get(adapter), []
        if node is None:
            return path
        for key in self._chunks(tokens, min(max_blocks, len(tokens) // self.block_tokens)):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        return path

    def has_device_kv(self, adapter: AdapterRef | None) -> bool:
        root = self.roots.get(adapter)
        return root is not None and root.num_device_children > 0

    def adapters_with_device_kv(self) -> list[AdapterRef]:
        """The adapters that device KV depends on (a copy: any thread)."""
        return [a for a, r in list(self.roots.items()) if a is not None and r.num_device_children]

    # ---- references ------------------------------------------------------------------------

    def hold(self, node: KVNode, now: float) -> None:
        self._update(node, node.refcount + 1, node.creator_active)
        node.visits += 1
        node.last_used = now

    def unhold(self, node: KVNode, created: bool, now: float) -> None:
        if node.refcount <= 0:
            raise RuntimeError("prefix node released more often than held")
        self._update(node, node.refcount - 1, node.creator_active and not created)
        node.last_used = now

    def _update(self, node: KVNode, refcount: int, creator_active: bool) -> None:
        before = node.pinned_unreserved, node.on_device and node.refcount > 0
        node.refcount, node.creator_active = refcount, creator_active
        after = node.pinned_unreserved, node.on_device and node.refcount > 0
        self.num_pinned_unreserved += after[0] - before[0]
        self.num_held += after[1] - before[1]
        self._refresh(node)

    def _refresh(self, node: KVNode) -> None:
        """Put `node` in the evictable set or take it out, as it is now."""
        if node.is_evictable_leaf:
            self._leaves[node] = None
        else:
            self._leaves.pop(node, None)

    # ---- growth ------------------------------------------------------------------------------

    def insert(
        self, parent: KVNode, tokens: list[int], blocks: list[int], now: float
    ) -> list[KVNode]:
        """Add blocks (full, in order) below `parent` for the request that computed them, which
        holds the new nodes. Stops at the first block another request already cached (that copy
        stays; the request keeps its own block as private). Returns the new nodes."""
        new = []
        for key, block in zip(self._chunks(tokens, len(blocks)), blocks):
            if key in parent.children:
                break
            node = KVNode(key, parent.adapter, parent, parent.depth + 1, block=block)
            if self.events is not None:
                name = parent.adapter.name if parent.adapter is not None else None
                node.block_hash = block_hash(parent.block_hash, key, name)
            node.refcount, node.creator_active = 1, True
            node.visits, node.last_used = 1, now
            parent.children[key] = node
            parent.num_device_children += 1
            self._leaves.pop(parent, None)  # it has a device child now
            self.num_device += 1
            self.num_held += 1
            new.append(node)
            parent = node
        if self.events is not None:
            self.events.stored(new, MEDIUM_DEVICE)
        return new

    # ---- moves (the memory manager copies the bytes) ----------------------------------------

    def nodes(self) -> Iterator[KVNode]:
        """Every KV node of every adapter (not the roots)."""
        stack = [n for r in self.roots.values() for n in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def device_leaves(self) -> list[KVNode]:
        """Device nodes without a reference or device children: what may leave the device."""
        return list(self._leaves)

    def host_nodes(self) -> list[KVNode]:
        return [n for n in self.nodes() if not n.on_device]

    def to_host(self, node: KVNode, host_block: int) -> int:
        """A device leaf now lives in `host_block`; returns the device block it gave up."""
        block, node.block, node.host_block = node.block, None, host_block
        node.parent.num_device_children -= 1
        self.num_device -= 1
        self.num_host += 1
        self._leaves.pop(node, None)
        self._refresh(node.parent)
        if self.events is not None:
            self.events.moved(node, MEDIUM_DEVICE, MEDIUM_HOST)
        return block

    def to_device(self, node: KVNode, block: int) -> int:
        """A host node whose parent is on the device comes back into `block`; returns its host
        block."""
        host, node.host_block, node.block = node.host_block, None, block
        node.parent.num_device_children += 1
        self.num_device += 1
        self.num_host -= 1
        self.num_held += node.refcount > 0  # a request that matched it holds it already
        self.num_pinned_unreserved += node.pinned_unreserved
        self._leaves.pop(node.parent, None)
        self._refresh(node)
        if self.events is not None:
            self.events.moved(node, MEDIUM_HOST, MEDIUM_DEVICE)
        return host

    def drop(self, node: KVNode) -> tuple[list[int], list[int]]:
        """Remove an unreferenced node and its (host) subtree. Returns (device blocks, host
        blocks) they held."""
        if node.refcount or node.num_device_children:
            raise RuntimeError("only an unreferenced leaf of the device may be dropped")
        return self.drop_subtree(node)

    def drop_subtree(self, node: KVNode) -> tuple[list[int], list[int]]:
        """Remove a node and everything below it, none of it referenced (an unregistered
        adapter's KV). Returns (device blocks, host blocks) they held."""
        device, host, stack = [], [], [node]
        gone: list[KVNode] = []
        while stack:
            n = stack.pop()
            if n.refcount:
                raise RuntimeError("a referenced prefix block cannot be dropped")
            stack.extend(n.children.values())
            self._leaves.pop(n, None)
            gone.append(n)
            if n.on_device:
                device.append(n.block)
                self.num_device -= 1
            else:
                host.append(n.host_block)
                self.num_host -= 1
        del node.parent.children[node.key]
        if node.on_device:
            node.parent.num_device_children -= 1
            self._refresh(node.parent)
        if not node.parent.children and node.parent.parent is None:
            del self.roots[node.parent.adapter]  # an adapter root with nothing below
        if self.events is not None:
            self.events.removed([n for n in gone if n.on_device], MEDIUM_DEVICE)
            self.events.removed([n for n in gone if not n.on_device], MEDIUM_HOST)
        return device, host
