"""The node's device memory for KV and adapters: what admission may promise, and each request's
share of the pool from admission to its end.

Layouts (`--memory-layout`, layout.py):
- `pool` (ELORA/FastLibra, Chameleon's idle-memory cache): one budget of blocks. A block holds
  `block_tokens` tokens of one request's KV, or a share of one adapter's weights (an adapter is
  charged ceil(bytes / block bytes) blocks, adapter_blocks.py). Adapters live in what KV does
  not use and leave (reference count 0 only) the moment KV needs room. Physically the KV tensors
  span the whole budget and the adapter weights sit in the adapter pool's tensors: the budget is
  enforced by the block accounting (blocks an adapter is charged are not handed to KV).
- `static`: `max_total_tokens` of KV and the adapter cache's own byte budget, kept to compare
  with.

Admission counts blocks that cannot be taken back: each admitted request's reservation (its
private blocks: for all of max_new_tokens, or for what its adapter's history expects with
--kv-admission expected, grown to the blocks it holds when it runs past that), cached prefix
blocks that running requests hold after their creator ended, and adapters with a reference or
a load still running. Everything else (free blocks, cached prefixes, idle adapters) can be
reclaimed on demand (reclaim.py), and a load nobody was promised (a prefetch) takes only blocks
not promised (adapter_blocks.py), so with worst-case reservations an admitted request never
fails to get a block (with expected ones, one that runs out preempts the youngest running
request: server.sched.scheduler). build.py puts the pieces together.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from toppings.gpu_lora.cache import AdapterCache
from toppings.gpu_lora.peft.adapter import LoraAdapter
from toppings.server.kv_events.publisher import KVEventPublisher
from toppings.server.memory.adapter_blocks import AdapterBlocks
from toppings.server.memory.counters import MemoryCounters
from toppings.server.memory.host_swap import HostSwap
from toppings.server.memory.kv_cache import KVPool
from toppings.server.memory.layout import Layout
from toppings.server.memory.prefix_tree import KVNode, PrefixTree
from toppings.server.memory.reclaim import Reclaimer
from toppings.server.requests.adapter_ref import AdapterRef

log = logging.getLogger(__name__)


@dataclass
class KVHold:
    """What one admitted request holds: its KV row, reservation and prefix-tree nodes."""

    row: int
    reserved: int  # private blocks promised at admission, grown to those it holds
    held: list[KVNode] = field(default_factory=list)  # its path in the tree, root side first
    num_matched: int = 0  # held[:num_matched] were cached before it came
    cached_tokens: int = 0  # prompt tokens whose KV came from the cache (the matched blocks)
    tail: KVNode | None = None  # where its next blocks go in the tree; None: not inserted
    max_blocks: int | None = None  # how many of its blocks the tree may keep (None: all)


class MemoryManager:
    """See the module docstring. Used by the engine thread only (views from any thread)."""

    def __init__(
        self,
        kv: KVPool,
        layout: Layout,
        tree: PrefixTree | None,
        swap: HostSwap | None,
        adapter_blocks: AdapterBlocks | None,
        adapter_cache: AdapterCache,
        reclaimer: Reclaimer,
        counters: MemoryCounters,
        kv_events: KVEventPublisher | None = None,
    ):
        """kv_events: the publisher of the tree's KV events (None: off); closed by `close`."""
        self.kv_events = kv_events
        self.kv, self.layout, self.tree, self.swap = kv, layout, tree, swap
        self.adapter_blocks = adapter_blocks  # None: adapters take no blocks of this pool
        self.adapter_cache = adapter_cache
        self.reclaimer = reclaimer
        self.counters = counters
        self.reserved = 0
        self._slot_bytes = kv.block_bytes / kv.block_tokens  # K and V of one token

    @property
    def shared(self) -> bool:
        """Whether adapters take blocks of this pool."""
        return self.adapter_blocks is not None

    # ---- the layout's answers, in KV tokens (the queue policies' sizes) ----------------------

    def adapter_tokens(self, num_bytes: int) -> int:
        """KV tokens' worth of memory an adapter of num_bytes takes; 0 while adapter memory is
        not scarce (a static layout without an adapter budget, a pool that charges none)."""
        if not self.layout.adapter_memory_is_scarce():
            return 0
        return -int(-num_bytes // self._slot_bytes)

    def total_tokens(self) -> int:
        """All the device memory requests compete for, in KV tokens."""
        return self.layout.total_tokens(self.kv.num_slots, self._slot_bytes)

    def free_tokens(self) -> int:
        """KV tokens not yet promised."""
        return (self.kv.num_blocks - self.committed()) * self.kv.block_tokens

    # ---- admission ---------------------------------------------------------------------------

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.kv.block_tokens)

    def blocks_for_bytes(self, num_bytes: int) -> int:
        return -(-num_bytes // self.kv.block_bytes)

    def adapter_need(self, adapter: AdapterRef | None, num_bytes: int) -> int:
        """Blocks admitting a request of `adapter` adds to the committed count."""
        if not self.shared or adapter is None:
            return 0
        pinned = self.adapter_cache.is_pinned(adapter.weights_id)
        return 0 if pinned else self.blocks_for_bytes(num_bytes)

    def committed(self) -> int:
        """Blocks that cannot be reclaimed now (see the module docstring)."""
        pinned = self.tree.num_pinned_unreserved if self.tree else 0
        if self.adapter_blocks is not None:
            pinned += self.adapter_blocks.num_blocks_of(self.adapter_cache.pinned())
        return self.reserved + pinned

    def tree_key(self, seq) -> tuple[AdapterRef | None, int | None]:
        """Under which adapter the tree keeps a request's blocks, and how many of them at most
        (None: all). An activated LoRA's blocks wholly before its activation are the base
        model's KV: they are matched and cached under the base model (None), shared with base
        requests and every other activated adapter. Its later blocks, the one holding the
        activation included, depend on where its prompt activates it and are not cached."""
        if seq.is_activated:
            return None, seq.lora_start // self.kv.block_tokens
        return seq.request.adapter, None

    def match(self, seq) -> list[KVNode]:
        """The cached prefix a request would reuse: full blocks under its adapter (`tree_key`),
        leaving at least its last prefill token to compute (a resumed request's prefill holds
        the tokens it made: `Sequence.resume`); host blocks only when a copy beats recomputing
        them."""
        if self.tree is None or seq.scores_prompt:
            return []
        ids = seq.prefill_ids
        adapter, max_blocks = self.tree_key(seq)
        num_blocks = (len(ids) - 1) // self.kv.block_tokens
        if max_blocks is not None:
            num_blocks = min(num_blocks, max_blocks)
        path = self.tree.match(adapter, ids, num_blocks)
        if self.swap is not None and not self.swap.copy_beats_recompute():
            path = [n for n in path if n.on_device]  # device nodes come first on any path
        return path  # without a host tier every cached node is on the device

    def kv_need(self, seq, path: list[KVNode]) -> int:
        """Blocks admitting `seq` with this cached prefix adds to the committed count."""
        shared = sum(1 for n in path if n.on_device and n.refcount)
        return self.blocks_for(_reserved_tokens(seq)) - shared

    def fits(self, extra_blocks: int) -> bool:
        return self.committed() + extra_blocks <= self.kv.num_blocks

    def admit(self, seq, path: list[KVNode], now: float) -> KVHold:
        """Take a row, the cached prefix (copied back from the host where needed) and the
        reservation of the rest."""
        hold = KVHold(self.kv.new_row(), self.blocks_for(_reserved_tokens(seq)) - len(path))
        self.reserved += hold.reserved
        for node in path:
            self.tree.hold(node, now)
            hold.held.append(node)
        on_host = [n for n in path if not n.on_device]
        self.make_room(len(on_host))  # a copy back takes a free block each
        for node in on_host:
            self.swap.swap_in(node)
        hold.num_matched = len(path)
        hold.cached_tokens = len(path) * self.kv.block_tokens
        self.kv.attach_prefix(hold.row, [n.block for n in path])
        if self.tree is not None:
            adapter, hold.max_blocks = self.tree_key(seq)
            hold.tail = path[-1] if path else self.tree.root(adapter)
        self.counters.prompt_tokens += seq.prefill_len
        self.counters.prefix_hit_tokens += hold.cached_tokens
        return hold

    # ---- as requests run --------------------------------------------------------------------

    def allocate(self, seqs: list, tokens: list[int]) -> list[int] | None:
        """Reserve the KV slots of a step: seqs[i]'s next tokens[i] tokens, all or none
        (cached items leave the device first where the free blocks are too few); returns
        where each one's tokens start, or None when the blocks cannot be had. A request that
        runs past its reservation (--kv-admission expected) has it grown to the blocks it
        holds, so that admission counts them."""
        kv = self.kv
        rows = [s.kv_hold.row for s in seqs]
        need = kv.missing_blocks(rows, tokens)
        if need > kv.num_free_blocks:
            self.make_room(need)
        if need > kv.num_free_blocks:
            return None
        starts = kv.reserve(rows, tokens)
        if need:
            for seq in seqs:
                hold = seq.kv_hold
                own = len(kv.row_blocks[hold.row]) - hold.num_matched
                if own > hold.reserved:
                    self.reserved += own - hold.reserved
                    hold.reserved = own
        return starts

    def make_adapter_room(
        self, adapter: LoraAdapter, keep: frozenset[int], prefetch: bool = False
    ) -> bool:
        """Evict until a load of `adapter` fits, before the adapter cache allocates it (the
        reclaimer decides, reclaim.py); whether it does. keep: ids of adapters of queued
        requests, evicted last; prefetch: a load no request waits for (spares them all)."""
        return self.reclaimer.make_adapter_room(adapter, keep, prefetch)

    def make_room(self, num_blocks: int) -> None:
        """Evict cached items until num_blocks are free (or nothing more may leave)."""
        if num_blocks > self.kv.num_free_blocks:
            self.reclaimer.reclaim(num_blocks - self.kv.num_free_blocks)

    def after_prefill(self, seqs, seconds: float, num_tokens: int, now: float) -> None:
        """Cache the prompt blocks just computed, visible at once to later requests."""
        if self.swap is not None:
            self.swap.observe_prefill(seconds, num_tokens)
        self.reclaimer.observe_batch(now, len(seqs))
        for seq in seqs:
            self._insert(seq.kv_hold, seq.prefill_ids, now)

    def after_decode(self, batch_size: int, now: float) -> None:
        self.reclaimer.observe_batch(now, batch_size)

    def tick(self, now: float) -> None:
        """The host tier's periodic swapping (reclaim.py)."""
        self.reclaimer.tick(now)

    def release(self, seq, keep_kv: bool, now: float) -> None:
        """Give back everything a request holds; with keep_kv, its computed blocks stay cached
        (finished, aborted or squashed requests: their KV is valid; not after an error)."""
        hold = seq.kv_hold
        if keep_kv:
            ids = (list(seq.request.prompt_ids) + seq.output_ids)[: self.kv.lengths[hold.row]]
            self._insert(hold, ids, now)
        for i, node in enumerate(hold.held):
            self.tree.unhold(node, i >= hold.num_matched, now)  # after the match: its own
        self.kv.free_row(hold.row, keep=[n.block for n in hold.held[hold.num_matched :]])
        self.reserved -= hold.reserved
        seq.kv_hold = None

    def _insert(self, hold: KVHold, ids: list[int], now: float) -> None:
        if self.tree is None or hold.tail is None:
            return
        done = len(hold.held)
        full = min(len(ids), self.kv.lengths[hold.row]) // self.kv.block_tokens
        if hold.max_blocks is not None:
            full = min(full, hold.max_blocks)
        if full <= done:
            return
        bt = self.kv.block_tokens
        blocks = self.kv.row_blocks[hold.row][done:full]
        if hold.tail.parent is None:  # a root: the tree drops empty ones, take the live one
            hold.tail = self.tree.root(hold.tail.adapter)
        new = self.tree.insert(hold.tail, ids[done * bt : full * bt], blocks, now)
        hold.held.extend(new)
        hold.tail = new[-1] if len(new) == len(blocks) else None  # a duplicate ends the chain

    def forget_adapter(self, adapter: AdapterRef) -> None:
        """An adapter was unregistered: its cached KV, which no request can match any more (the
        tree is keyed by id), gives its blocks back now rather than when evicted. None of it is
        held: removal waits for its requests."""
        if self.tree is None or adapter not in self.tree.roots:
            return
        for node in list(self.tree.roots[adapter].children.values()):
            device, host = self.tree.drop_subtree(node)
            self.kv.free_blocks(device)
            if self.swap is not None:
                self.swap.free(host)

    def close(self) -> None:
        """Send the KV events still queued and stop their publisher (the engine's shutdown)."""
        if self.kv_events is not None:
            self.kv_events.close()

    # ---- views ------------------------------------------------------------------------------

    def view(self) -> dict:
        """Pool blocks by kind and the counters, for /stats and /metrics."""
        total, free = self.kv.num_blocks, self.kv.num_free_blocks
        cached = (self.tree.num_device - self.tree.num_held) if self.tree else 0
        in_use = idle = 0
        if self.adapter_blocks is not None:
            in_use = self.adapter_blocks.num_blocks_of(self.adapter_cache.referenced())
            idle = self.adapter_blocks.num_blocks() - in_use
        return {
            "layout": self.layout.kind.value,
            "block_tokens": self.kv.block_tokens,
            "block_bytes": self.kv.block_bytes,
            "blocks": {
                "total": total,
                "free": free,
                "kv_in_use": total - free - cached - in_use - idle,
                "kv_cached": cached,
                "adapters_in_use": in_use,
                "adapters_cached": idle,
            },
            "host_blocks": {
                "total": self.swap.num_blocks if self.swap else 0,
                "used": self.swap.num_used if self.swap else 0,
            },
            "reserved_blocks": self.reserved,
            "committed_blocks": self.committed(),
            **vars(self.counters),
            **self._kv_events_counts(),
        }

    def _kv_events_counts(self) -> dict:
        """The KV events stream's counts (none when events are off): batches published, tree
        changes dropped to a full queue, resyncs a late consumer's replay asked for."""
        if self.kv_events is None:
            return {}
        recorder = self.kv_events.recorder
        return {
            "kv_events_batches": self.kv_events.num_batches,
            "kv_events_dropped": recorder.num_dropped,
            "kv_events_resyncs_asked": recorder.num_resyncs_asked,
        }


def _reserved_tokens(seq) -> int:
    """The tokens a request's admission reserves: its `kv_need` (all of max_new_tokens, or
    what its adapter's history expects), and at least its prefill and the token after it."""
    return max(seq.kv_need, seq.prefill_len + 1)
