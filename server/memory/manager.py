"""The node's device memory for KV and adapters: budget, prefix reuse, eviction, host tier.

Layouts (`--memory-layout`):
- `pool` (ELORA/FastLibra, Chameleon's idle-memory cache): one budget of blocks. A block holds
  `block_tokens` tokens of one request's KV, or a share of one adapter's weights (an adapter is
  charged ceil(bytes / block bytes) blocks). Adapters live in what KV does not use and leave
  (reference count 0 only) the moment KV needs room. Physically the KV tensors span the whole
  budget and the adapter weights sit in the adapter pool's tensors: the budget is enforced by
  the block accounting (blocks an adapter is charged are not handed to KV).
- `static`: today's split, kept to compare with: `max_total_tokens` of KV and the adapter
  cache's own byte budget.

Admission counts blocks that cannot be taken back: each admitted request's reservation (its
private blocks, worst case), cached prefix blocks that running requests hold after their
creator ended, and adapters with a reference. Everything else (free blocks, cached prefixes,
idle adapters) can be reclaimed on demand, so an admitted request never fails to get a block.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from toppings.server.memory.host_tier import HostKV
from toppings.server.memory.kv_cache import KVPool
from toppings.server.memory.policies import (
    Candidate,
    PoolContext,
    expected_adapters,
    make_memory_policy,
)
from toppings.server.memory.prefix_tree import KVNode, PrefixTree

log = logging.getLogger(__name__)

HIGH_WATERMARK, LOW_WATERMARK = 0.95, 0.70  # FastLibra's busy / idle thresholds
TICK_S = 0.1  # how often the watermarks are looked at
RECLAIM_SHARE = 64  # a reclaim frees at least 1/64 of the pool


@dataclass
class KVHold:
    """What one admitted request holds: its KV row, reservation and prefix-tree nodes."""

    row: int
    reserved: int  # private blocks promised (worst case)
    held: list[KVNode] = field(default_factory=list)  # its path in the tree, root side first
    num_matched: int = 0  # held[:num_matched] were cached before it came
    tail: KVNode | None = None  # where its next blocks go in the tree; None: not inserted


@dataclass
class MemoryCounters:
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    swaps_in: int = 0
    swaps_out: int = 0
    evictions_kv: int = 0
    evictions_adapter: int = 0


class MemoryManager:
    """See the module docstring. Used by the engine thread only (views from any thread)."""

    def __init__(self, kv: KVPool, layout: str, prefix_cache: bool, policy: str,
                 host_blocks: int = 0, link_gbps: float = 0.0):  # fmt: skip
        self.kv, self.layout = kv, layout
        self.shared = False  # whether adapters take blocks of this pool (attach_adapters)
        self.tree = PrefixTree(kv.block_tokens) if prefix_cache else None
        self.host = HostKV(kv, host_blocks, link_gbps) if host_blocks and prefix_cache else None
        self.policy = make_memory_policy(policy)
        self.cache = None  # gpu_lora.cache.AdapterCache, set by `attach_adapters`
        self.adapter_blocks: dict[str, list[int]] = {}
        self.reserved = 0
        self.counters = MemoryCounters()
        self._batch_sizes: deque[tuple[float, int]] = deque(maxlen=256)
        self._next_tick = 0.0
        self._prefill_s_per_token = 1e-3  # refined from measured prefills
        kv.reclaim = self._reclaim

    def attach_adapters(self, cache, charged: bool) -> None:
        """The adapter cache whose idle entries may be evicted; with `charged`, adapters take
        blocks of this pool (the cache charges each load)."""
        self.cache = cache
        self.shared = charged
        if charged:
            cache.charge = self

    # ---- admission ---------------------------------------------------------------------------

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.kv.block_tokens)

    def adapter_need(self, name: str | None, num_bytes: int) -> int:
        """Blocks admitting a request of adapter `name` adds to the committed count."""
        if not self.shared or name is None:
            return 0
        entry = self.cache.entries.get(name)
        return 0 if entry is not None and entry.refcount else self.blocks_for_bytes(num_bytes)

    def blocks_for_bytes(self, num_bytes: int) -> int:
        return -(-num_bytes // self.kv.block_bytes)

    def committed(self) -> int:
        """Blocks that cannot be reclaimed now (see the module docstring)."""
        pinned = self.tree.num_pinned_unreserved if self.tree else 0
        if self.shared and self.cache is not None:
            pinned += sum(
                len(self.adapter_blocks.get(n, ()))
                for n, e in list(self.cache.entries.items()) if e.refcount
            )  # fmt: skip
        return self.reserved + pinned

    def match(self, seq) -> list[KVNode]:
        """The cached prefix a request would reuse: full blocks under its own adapter, leaving
        at least its last prompt token to compute; host blocks only when a copy beats
        recomputing them."""
        if self.tree is None or seq.request.params.prompt_logprobs is not None:
            return []
        ids = seq.request.prompt_ids
        path = self.tree.match(seq.request.adapter, ids, (len(ids) - 1) // self.kv.block_tokens)
        if self.host is not None and self.host.seconds_per_block() > self._recompute_s():
            path = [n for n in path if n.on_device]  # device nodes come first on any path
        return path  # without a host tier every cached node is on the device

    def kv_need(self, seq, path: list[KVNode]) -> int:
        """Blocks admitting `seq` with this cached prefix adds to the committed count."""
        shared = sum(1 for n in path if n.on_device and n.refcount)
        return self.blocks_for(seq.kv_need) - shared

    def fits(self, extra_blocks: int) -> bool:
        return self.committed() + extra_blocks <= self.kv.num_blocks

    def admit(self, seq, path: list[KVNode], now: float) -> KVHold:
        """Take a row, the cached prefix (copied back from the host where needed) and the
        reservation of the rest."""
        hold = KVHold(self.kv.new_row(), self.blocks_for(seq.kv_need) - len(path))
        self.reserved += hold.reserved
        for node in path:
            self.tree.hold(node, now)
            hold.held.append(node)
        for node in path:
            if not node.on_device:
                self._swap_in(node)
        hold.num_matched = len(path)
        self.kv.attach_prefix(hold.row, [n.block for n in path])
        if self.tree is not None:
            hold.tail = path[-1] if path else self.tree.root(seq.request.adapter)
        self.counters.prompt_tokens += seq.prompt_len
        self.counters.prefix_hit_tokens += len(path) * self.kv.block_tokens
        return hold

    # ---- as requests run --------------------------------------------------------------------

    def after_prefill(self, seqs, seconds: float, num_tokens: int, now: float) -> None:
        """Cache the prompt blocks just computed, visible at once to later requests."""
        if num_tokens:
            self._prefill_s_per_token = 0.8 * self._prefill_s_per_token + 0.2 * (
                seconds / num_tokens
            )
        self._batch_sizes.append((now, len(seqs)))
        for seq in seqs:
            self._insert(seq.kv_hold, seq.request.prompt_ids, now)

    def after_decode(self, batch_size: int, now: float) -> None:
        self._batch_sizes.append((now, batch_size))

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
        if full <= done:
            return
        bt = self.kv.block_tokens
        blocks = self.kv.row_blocks[hold.row][done:full]
        if hold.tail.parent is None:  # a root: the tree drops empty ones, take the live one
            hold.tail = self.tree.root(hold.tail.adapter)
        new = self.tree.insert(hold.tail, ids[done * bt : full * bt], blocks, now)
        hold.held.extend(new)
        hold.tail = new[-1] if len(new) == len(blocks) else None  # a duplicate ends the chain

    def forget_adapter(self, name: str) -> None:
        """An adapter was unregistered: its cached KV is dropped (a new adapter of the same
        name must not find it). None of it is held: removal waits for its requests."""
        if self.tree is None or name not in self.tree.roots:
            return
        for node in list(self.tree.roots[name].children.values()):
            device, host = self.tree.drop_subtree(node)
            self.kv.free_blocks(device)
            if self.host is not None:
                self.host.free(host)

    # ---- adapters' blocks (pool layout; called by the adapter cache) -------------------------

    def take(
        self, name: str, num_bytes: int, keep: frozenset[str] = frozenset(), reclaim: bool = True
    ) -> bool:
        """Charge an adapter's blocks; with reclaim, evict cached KV or idle adapters first
        (those in `keep`, wanted by queued requests, last)."""
        need = self.blocks_for_bytes(num_bytes)
        if need > self.kv.num_free_blocks and reclaim:
            self._reclaim(need - self.kv.num_free_blocks, keep)
        if need > self.kv.num_free_blocks:
            return False
        self.adapter_blocks[name] = self.kv.alloc_blocks(need)
        return True

    def give(self, name: str) -> None:
        self.kv.free_blocks(self.adapter_blocks.pop(name, ()))

    # ---- eviction and the host tier -----------------------------------------------------------

    def _candidates(self, kinds: tuple[str, ...]) -> list[Candidate]:
        out = []
        if self.tree is not None and "kv" in kinds:
            out += [Candidate("kv", n, self.kv.block_bytes, n.visits, n.last_used)
                    for n in self.tree.device_leaves()]  # fmt: skip
        if self.shared and self.cache is not None and "adapter" in kinds:
            for name, entry in list(self.cache.entries.items()):
                if entry.refcount or not entry.ticket.done:
                    continue
                if self.tree is not None and self.tree.has_device_kv(name):
                    continue  # its cached KV depends on it: those leave first
                usage = self.cache.usage(name)
                out.append(Candidate("adapter", name, entry.num_bytes, usage.frequency,
                                     usage.last_used))  # fmt: skip
        return out

    def _context(self, now: float, candidates: list[Candidate]) -> PoolContext:
        visits = {"kv": sum(c.visits for c in candidates if c.kind == "kv"), "adapter": 0}
        adapters = {}
        if self.cache is not None:
            adapters = {n: u.frequency for n, u in self.cache.usages().items()}
            visits["adapter"] = sum(adapters.values())
        recent = [b for t, b in self._batch_sizes if now - t <= 5.0]
        batch = sum(recent) / len(recent) if recent else 1.0
        cached = len(self.cache.entries) if self.cache is not None else 0
        return PoolContext(now, visits, expected_adapters(adapters, batch), cached)

    def _reclaim(self, num_blocks: int, keep: frozenset[str] = frozenset()) -> int:
        """Free at least num_blocks by moving cached leaves off the device; returns how many
        it freed (fewer only when nothing more may leave)."""
        freed, now = 0, time.monotonic()
        # Free a little more than asked: each round walks the tree, and decode steps ask for a
        # block at a time.
        num_blocks = max(num_blocks, self.kv.num_blocks // RECLAIM_SHARE)
        while freed < num_blocks:
            cands = self._candidates(("kv", "adapter"))
            ordered = self.policy.order(cands, self._context(now, cands))
            if not ordered:
                break
            ordered.sort(key=lambda c: c.kind == "adapter" and c.item in keep)  # stable
            for cand in ordered:
                if freed >= num_blocks:
                    break
                freed += self._evict(cand)
        return freed

    def _evict(self, cand: Candidate) -> int:
        before = self.kv.num_free_blocks
        if cand.kind == "adapter":
            self.cache.evict(cand.item)  # calls `give`
            self.counters.evictions_adapter += 1
        elif self.host is not None and self._host_room():
            host_block = self.host.alloc()
            self.host.swap_out(cand.item.block, host_block)
            self.kv.free_blocks([self.tree.to_host(cand.item, host_block)])
            self.counters.swaps_out += 1
        else:
            device, host = self.tree.drop(cand.item)
            self.kv.free_blocks(device)
            if self.host is not None:
                self.host.free(host)
            self.counters.evictions_kv += 1
        return self.kv.num_free_blocks - before

    def _host_room(self) -> bool:
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

    def _swap_in(self, node: KVNode) -> None:
        block = self.kv.alloc_blocks(1)[0]
        self.host.swap_in(node.host_block, block)
        self.host.free([self.tree.to_device(node, block)])
        self.counters.swaps_in += 1

    def _recompute_s(self) -> float:
        return self._prefill_s_per_token * self.kv.block_tokens

    def tick(self, now: float) -> None:
        """FastLibra's swapper, about every 100 ms: above the high watermark, cached leaves
        leave the device down to the low one; below the low one, host blocks come back."""
        if self.host is None or now < self._next_tick:
            return
        self._next_tick = now + TICK_S
        total = self.kv.num_blocks
        used = total - self.kv.num_free_blocks
        if used > HIGH_WATERMARK * total:
            self._reclaim(used - int(LOW_WATERMARK * total))
        elif used < LOW_WATERMARK * total and self.host.seconds_per_block() <= self._recompute_s():
            self._swap_in_idle(int(LOW_WATERMARK * total) - used, now)

    def _swap_in_idle(self, num_blocks: int, now: float) -> None:
        roots = [n for n in self.tree.host_nodes() if n.parent.parent is None or n.parent.on_device]
        roots = [n for n in roots if not self.shared or n.adapter is None
                 or n.adapter in self.cache.entries]  # fmt: skip
        cands = [Candidate("kv", n, self.kv.block_bytes, n.visits, n.last_used) for n in roots]
        for cand in reversed(self.policy.order(cands, self._context(now, cands))[-num_blocks:]):
            if not self.kv.num_free_blocks:
                break
            self._swap_in(cand.item)

    # ---- views ------------------------------------------------------------------------------

    def view(self) -> dict:
        """Pool blocks by kind and the counters, for /stats and /metrics."""
        total, free = self.kv.num_blocks, self.kv.num_free_blocks
        cached = (self.tree.num_device - self.tree.num_held) if self.tree else 0
        entries = list(self.cache.entries.items()) if self.cache is not None else []
        blocks = {n: len(b) for n, b in list(self.adapter_blocks.items())}
        in_use = sum(blocks.get(n, 0) for n, e in entries if e.refcount)
        idle = sum(blocks.values()) - in_use
        return {
            "layout": self.layout,
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
                "total": self.host.num_blocks if self.host else 0,
                "used": (self.host.num_blocks - self.host.num_free) if self.host else 0,
            },
            "reserved_blocks": self.reserved,
            "committed_blocks": self.committed(),
            **vars(self.counters),
        }


POOL_SHARE_OF_FREE = 0.4  # CUDA: the memory pool's default share of the free device memory


def kv_slots(config, model_config, itemsize: int, free_device_bytes) -> int:
    """KV token slots of an engine: the static split's max_total_tokens, or the pool's budget.

    config: EngineConfig; model_config: ModelConfig; itemsize: bytes per KV element;
    free_device_bytes: () -> free bytes of the device (asked only on CUDA without a budget).
    """
    cfg, mc = config, model_config
    if cfg.memory_layout == "static":
        return cfg.max_total_tokens
    slot_bytes = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * itemsize
    budget = cfg.memory_bytes
    if not budget and cfg.device == "cuda":
        # Adapter weights sit in their own tensors beside the KV ones: leave them as much
        # again as the pool.
        budget = int(POOL_SHARE_OF_FREE * free_device_bytes())
    elif not budget:
        budget = cfg.max_total_tokens * slot_bytes + cfg.adapter_cache_bytes
    return max(budget // slot_bytes, cfg.block_tokens)
