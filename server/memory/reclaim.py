"""Making room in the pool: which cached items leave the device, and the host tier's watermarks.

A reclaim frees blocks by moving cached items off the device in the memory policy's order:
prefix-tree leaves (to the host tier when there is one, else dropped) and, where adapters are
charged to the pool, idle adapters (no reference, loaded, no device KV below them). Adapters of
queued requests go last. The memory manager calls `reclaim` before it reserves a step's KV slots
(in the scheduler, before the step runs) when too few blocks are free; the adapter blocks call
it when a load needs room (at admission). Nothing reclaims during a forward pass.

FastLibra's swapper (`tick`, about every 100 ms): above the high watermark cached leaves leave
the device down to the low one; below the low one, host blocks come back while copying them
beats recomputing them.
"""

from __future__ import annotations

from toppings.gpu_lora.cache import AdapterCache
from toppings.gpu_lora.eviction import Candidate, ItemKind
from toppings.server.memory.counters import MemoryCounters
from toppings.server.memory.host_swap import HostSwap
from toppings.server.memory.kv_cache import KVPool
from toppings.server.memory.prefix_tree import PrefixTree

HIGH_WATERMARK, LOW_WATERMARK = 0.95, 0.70  # FastLibra's busy / idle thresholds
TICK_S = 0.1  # how often the watermarks are looked at
RECLAIM_SHARE = 64  # a reclaim frees at least 1/64 of the pool


class Reclaimer:
    """Eviction and the host tier's watermarks; see the module docstring."""

    def __init__(
        self,
        kv: KVPool,
        tree: PrefixTree | None,
        swap: HostSwap | None,
        cache: AdapterCache,
        charges_adapters: bool,
        counters: MemoryCounters,
    ):
        """cache: the device adapter cache, whose idle adapters are candidates when
        `charges_adapters`, and whose `order` (the node's one eviction table) orders every
        candidate."""
        self.kv, self.tree, self.swap, self.cache = kv, tree, swap, cache
        self.charges_adapters = charges_adapters  # idle adapters are candidates too
        self.counters = counters
        self._next_tick = 0.0

    def observe_batch(self, now: float, batch_size: int) -> None:
        """A step ran `batch_size` requests (FastLibra's expected adapters use the recent size)."""
        self.cache.eviction.observe_batch(now, batch_size)

    def _candidates(self) -> list[Candidate]:
        out = []
        if self.tree is not None:
            out += [Candidate(ItemKind.KV, n, self.kv.block_bytes, n.visits, n.last_used)
                    for n in self.tree.device_leaves()]  # fmt: skip
        if self.charges_adapters:
            # Adapters whose cached KV is on the device stay: those blocks leave first. The
            # tree keys adapters by reference, the cache by the reference's weights id.
            with_kv = set()
            if self.tree is not None:
                with_kv = {a.weights_id for a in self.tree.adapters_with_device_kv()}
            out += [c for c in self.cache.idle_candidates() if c.item not in with_kv]
        return out

    def order(self, keep: frozenset[int] = frozenset()) -> list[Candidate]:
        """Every item that may leave the device now, first to leave first (the node's eviction
        policy; adapters whose ids are in `keep`, wanted by queued requests, last)."""
        ordered = self.cache.order(self._candidates())
        ordered.sort(key=lambda c: c.kind is ItemKind.ADAPTER and c.item in keep)  # stable
        return ordered

    def reclaim(self, num_blocks: int, keep: frozenset[int] = frozenset()) -> int:
        """Free at least num_blocks by moving cached items off the device; returns how many
        it freed (fewer only when nothing more may leave)."""
        freed = 0
        # Free a little more than asked: each round orders every candidate, and decode steps
        # ask for a block at a time.
        num_blocks = max(num_blocks, self.kv.num_blocks // RECLAIM_SHARE)
        while freed < num_blocks:
            ordered = self.order(keep)
            if not ordered:
                break
            for cand in ordered:
                if freed >= num_blocks:
                    break
                freed += self._evict(cand)
        return freed

    def _evict(self, cand: Candidate) -> int:
        before = self.kv.num_free_blocks
        if cand.kind is ItemKind.ADAPTER:
            self.cache.evict(cand.item)  # gives its blocks back
            self.counters.evictions_adapter += 1
        elif self.swap is not None and self.swap.make_room():
            self.swap.swap_out(cand.item)
        else:
            device, host = self.tree.drop(cand.item)
            self.kv.free_blocks(device)
            if self.swap is not None:
                self.swap.free(host)
            self.counters.evictions_kv += 1
        return self.kv.num_free_blocks - before

    def tick(self, now: float) -> None:
        """The swapper's watermarks (see the module docstring); a no-op without a host tier."""
        if self.swap is None or now < self._next_tick:
            return
        self._next_tick = now + TICK_S
        total = self.kv.num_blocks
        used = total - self.kv.num_free_blocks
        if used > HIGH_WATERMARK * total:
            self.reclaim(used - int(LOW_WATERMARK * total))
        elif used < LOW_WATERMARK * total and self.swap.copy_beats_recompute():
            self._swap_in_idle(int(LOW_WATERMARK * total) - used, now)

    def _swap_in_idle(self, num_blocks: int, now: float) -> None:
        roots = self.swap.idle_returnable()
        if self.charges_adapters:  # a node comes back only with its adapter on the device
            roots = [n for n in roots
                     if n.adapter is None or self.cache.holds(n.adapter.weights_id)]  # fmt: skip
        cands = [Candidate(ItemKind.KV, n, self.kv.block_bytes, n.visits, n.last_used)
                 for n in roots]  # fmt: skip
        for cand in reversed(self.cache.order(cands)[-num_blocks:]):
            if not self.kv.num_free_blocks:
                break
            self.swap.swap_in(cand.item)
