"""Making room on the device: the node's one owner of eviction, and the host tier's watermarks.

The reclaimer holds the node's `Eviction` table (gpu_lora/eviction.py) and is the only one that
decides what leaves the device, in both memory layouts; the adapter cache offers candidates and
evicts only what it is told to. A reclaim frees blocks by moving cached items off the device in
the table's order: prefix-tree leaves (to the host tier when there is one, else dropped) and,
where adapters are charged to the pool, idle adapters (no reference, loaded, no device KV below
them). Adapters of queued requests go last. The memory manager calls `reclaim` before it
reserves a step's KV slots (in the scheduler, before the step runs) when too few blocks are
free. At admission, `make_adapter_room` makes room for a request's adapter before the cache
allocates it: idle adapters leave until the cache's own limits (its byte budget, its pool's
rows) hold the load, then, where adapters are charged to the pool, a reclaim frees its blocks.
Nothing reclaims during a forward pass.

FastLibra's swapper (`tick`, about every 100 ms): above the high watermark cached leaves leave
the device down to the low one; below the low one, host blocks come back while copying them
beats recomputing them.
"""

from __future__ import annotations

import time

from toppings.gpu_lora.cache import AdapterCache
from toppings.gpu_lora.eviction import Candidate, Eviction, ItemKind
from toppings.gpu_lora.peft.adapter import LoraAdapter
from toppings.server.memory.adapter_blocks import AdapterBlocks
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
        blocks: AdapterBlocks | None,
        counters: MemoryCounters,
        eviction: Eviction,
    ):
        """cache: the device adapter cache, whose unreferenced adapters are candidates; blocks:
        the pool blocks charged to adapters (None: adapters take no blocks, and only an
        adapter's load makes them leave); eviction: the node's one eviction table."""
        self.kv, self.tree, self.swap, self.cache = kv, tree, swap, cache
        self.blocks = blocks
        self.charges_adapters = blocks is not None  # idle adapters are pool candidates too
        self.counters = counters
        self.eviction = eviction
        self._next_tick = 0.0

    def observe_batch(self, now: float, batch_size: int) -> None:
        """A step ran `batch_size` requests (FastLibra's expected adapters use the recent size)."""
        self.eviction.observe_batch(now, batch_size)

    def _ordered(self, candidates: list[Candidate]) -> list[Candidate]:
        """`candidates` in the table's order, first to leave first, with what it may know of
        the node: the adapters' request counts and how many are on the device."""
        cache = self.cache
        return self.eviction.order(
            candidates, time.monotonic(), cache.frequencies(), cache.num_entries
        )

    def adapter_order(
        self, keep: frozenset[int] = frozenset(), spare_keep: bool = False
    ) -> list[Candidate]:
        """The adapters no request holds, first to leave first: those no queued request wants
        (ids not in `keep`) in the table's order, then (unless `spare_keep`) the others."""
        free = self.cache.candidates()
        groups = [[c for c in free if c.item not in keep], [c for c in free if c.item in keep]]
        order: list[Candidate] = []
        for group in groups[:1] if spare_keep else groups:
            if group:
                order += self._ordered(group)
        return order

    def make_adapter_room(
        self, adapter: LoraAdapter, keep: frozenset[int], prefetch: bool = False
    ) -> bool:
        """Evict until a load of `adapter` fits, so that the cache's `acquire` (or `prefetch`)
        then only allocates; whether it does (an adapter already cached always does). keep:
        ids of adapters of queued requests, evicted only when nothing else frees enough room;
        prefetch: a load no request waits for, which evicts only adapters no one holds or
        wants and takes only free blocks (adapter_blocks.py)."""
        cache = self.cache
        cache.drop_idle(spare=adapter.id)  # without a cache, idle adapters leave first
        if cache.holds(adapter.id) or not cache.can_ever_hold(adapter):
            return True  # a hit needs no room; one too large is refused by the cache, by name
        while not cache.has_room(adapter):  # only an adapter leaving frees the cache's room
            order = self.adapter_order(keep, spare_keep=prefetch)
            if not order:
                return False
            self._evict(order[0])
        if cache.waits_for_loader(adapter):
            return False  # no cached KV leaves for a load that cannot start yet
        if self.blocks is None or prefetch:
            return True
        need = self.blocks.blocks_for_bytes(cache.charge(adapter))
        if need > self.kv.num_free_blocks:
            self.reclaim(need - self.kv.num_free_blocks, keep)
        return need <= self.kv.num_free_blocks

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
        ordered = self._ordered(self._candidates())
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
            if self.charges_adapters:  # the pool's count; the cache counts in either layout
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
        for cand in reversed(self._ordered(cands)[-num_blocks:]):
            if not self.kv.num_free_blocks:
                break
            self.swap.swap_in(cand.item)
