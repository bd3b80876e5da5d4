"""Moving cached prefix blocks between the device pool and the host tier.

The prefix tree records where a node lives, `HostKV` copies the bytes; this keeps the two in
step and decides whether copying a block back beats recomputing it, from the measured prefill
rate and the link's time per block.
"""

from __future__ import annotations

from toppings.server.memory.counters import MemoryCounters
from toppings.server.memory.host_tier import HostKV
from toppings.server.memory.kv_cache import KVPool
from toppings.server.memory.prefix_tree import KVNode, PrefixTree


class HostSwap:
    """The host tier of the prefix cache; see the module docstring."""

    def __init__(self, kv: KVPool, tree: PrefixTree, host: HostKV, counters: MemoryCounters):
        self.kv, self.tree, self.host, self.counters = kv, tree, host, counters
        self._prefill_s_per_token = 1e-3  # refined from measured prefills

    def observe_prefill(self, seconds: float, num_tokens: int) -> None:
        if num_tokens:
            self._prefill_s_per_token = 0.8 * self._prefill_s_per_token + 0.2 * (
                seconds / num_tokens
            )

    def copy_beats_recompute(self) -> bool:
        """Whether copying a block back from the host is no slower than recomputing it."""
        return self.host.seconds_per_block() <= self._prefill_s_per_token * self.kv.block_tokens

    def make_room(self) -> bool:
        """A free host block, dropping the least recently used host leaf if needed."""
        if self.host.num_free:
            return True
        leaves = [n for n in self.tree.host_nodes() if not n.children and not n.refcount]
        if not leaves:
            return False
        _, host = self.tree.drop(min(leaves, key=lambda n: n.last_used))
        self.host.free(host)
        self.counters.evictions_kv += 1
        return True

    def swap_out(self, node: KVNode) -> None:
        """Move a device leaf to a free host block (`make_room` first)."""
        host_block = self.host.alloc()
        self.host.swap_out(node.block, host_block)
        self.kv.free_blocks([self.tree.to_host(node, host_block)])
        self.counters.swaps_out += 1

    def swap_in(self, node: KVNode) -> None:
        """Bring a host node whose parent is on the device back into a device block."""
        block = self.kv.alloc_blocks(1)[0]
        self.host.swap_in(node.host_block, block)
        self.host.free([self.tree.to_device(node, block)])
        self.counters.swaps_in += 1

    def free(self, host_blocks: list[int]) -> None:
        self.host.free(host_blocks)

    def idle_returnable(self) -> list[KVNode]:
        """Host nodes that may come back now: right below an adapter root or a device node."""
        return [n for n in self.tree.host_nodes() if n.parent.parent is None or n.parent.on_device]

    @property
    def num_blocks(self) -> int:
        return self.host.num_blocks

    @property
    def num_used(self) -> int:
        return self.host.num_blocks - self.host.num_free
