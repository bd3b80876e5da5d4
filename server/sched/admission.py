"""The engine's side of admission: what a queue policy may ask while it forms one batch.

One `EngineGate` per iteration. `try_admit` checks a request against what is free now (batch
rows, the memory not yet promised (memory/manager.py), the prefill token budget, adapter memory,
the LoRA mode) and, when it fits, takes its adapter reference, its KV row, its cached prefix and
the reservation of the rest. `squash` undoes all of that for a
running request, which then waits again (Chameleon's squash of a bypasser).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from toppings.server.requests.sequence import Sequence
from toppings.server.sched.queueing import Verdict

if TYPE_CHECKING:
    from toppings.server.engine.engine import Engine


class EngineGate:
    """Admission checks of one engine iteration (the engine thread, under its lock)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.admitted: list[Sequence] = []
        self.prefill_tokens = 0
        kv = engine.kv
        self._slot_bytes = kv.block_bytes / kv.block_tokens  # K and V of one token
        self._queued: frozenset[str] | None = None

    def try_admit(self, seq: Sequence) -> Verdict:
        eng, cfg, mem = self.engine, self.engine.config, self.engine.memory
        if len(eng._running) + len(self.admitted) >= cfg.max_batch_size:
            return Verdict.BATCH_FULL
        adapter = seq.request.adapter
        path = mem.match(seq)
        computed = seq.prompt_len - len(path) * eng.kv.block_tokens
        need = mem.kv_need(seq, path)
        if seq.cache_entry is None:
            need += mem.adapter_need(adapter, eng.lora.bytes_of(adapter))
        if not mem.fits(need) or (
            self.admitted and self.prefill_tokens + computed > cfg.max_prefill_tokens
        ):
            return Verdict.NO_ROOM
        if adapter is not None and seq.cache_entry is None:
            seq.cache_entry = eng.lora.acquire(adapter, self.queued())
            if seq.cache_entry is None:
                return Verdict.NO_ADAPTER_MEMORY  # none until a running request ends
            path = mem.match(seq)  # the load may have taken cached blocks
            computed = seq.prompt_len - len(path) * eng.kv.block_tokens
            if not mem.fits(mem.kv_need(seq, path)):
                # Holding the adapter while waiting for KV room could pin the pool full of
                # adapters no one runs: let it go (it stays cached while memory allows).
                eng.lora.release(adapter)
                seq.cache_entry = None
                return Verdict.NO_ROOM
        if not eng.lora.may_start(seq.cache_entry):
            return Verdict.NOT_READY
        seq.kv_hold = mem.admit(seq, path, time.monotonic())
        self.prefill_tokens += computed
        self.admitted.append(seq)
        return Verdict.ADMITTED

    def queued(self) -> frozenset[str]:
        """Adapters of the waiting requests (eviction spares them while it can)."""
        if self._queued is None:
            self._queued = frozenset(
                s.request.adapter for s in self.engine.queue if s.request.adapter
            )
        return self._queued

    def squash(self, seq: Sequence) -> None:
        self.engine._running.remove(seq)
        self.engine.release(seq)
        seq.restart()

    def fits_if_released(self, waiting: Sequence, running: Sequence) -> bool:
        return self.engine.lora.fits_if_released(waiting.request.adapter, running.request.adapter)

    def adapter_tokens(self, adapter: str | None) -> int:
        """KV tokens' worth of memory the adapter takes (0 while adapter memory is not scarce:
        a static layout without an adapter budget, or a pool that does not charge adapters)."""
        eng = self.engine
        if eng.config.memory_layout == "pool":
            scarce = eng.memory.shared
        else:
            scarce = bool(eng.config.adapter_cache_bytes)
        if not scarce or adapter is None:
            return 0
        return -int(-eng.lora.bytes_of(adapter) // self._slot_bytes)

    def adapter_size(self, adapter: str | None) -> float:
        """The adapter's bytes; the base model counts as the smallest adapter (its requests
        are sized by their lengths, not put all in the first queue)."""
        if adapter is not None:
            return float(self.engine.lora.bytes_of(adapter))
        sizes = [self.engine.lora.bytes_of(n) for n in list(self.engine.lora.registry)]
        return float(min(sizes, default=1))

    def max_adapter_size(self) -> float:
        sizes = [self.engine.lora.bytes_of(n) for n in list(self.engine.lora.registry)]
        return float(max(sizes, default=1))

    def total_tokens(self) -> int:
        cfg, kv = self.engine.config, self.engine.kv
        if cfg.memory_layout == "pool":
            return kv.num_slots
        return kv.num_slots + int(cfg.adapter_cache_bytes // self._slot_bytes)

    def prefetch(self, adapters: list[str]) -> None:
        self.engine.lora.prefetch(adapters, self.queued())

    def free_tokens(self) -> int:
        mem = self.engine.memory
        return (mem.kv.num_blocks - mem.committed()) * mem.kv.block_tokens

    def free_rows(self) -> int:
        eng = self.engine
        return eng.config.max_batch_size - len(eng._running) - len(self.admitted)

    def need_tokens(self, seq: Sequence) -> int:
        mem, lora = self.engine.memory, self.engine.lora
        need = mem.kv_need(seq, mem.match(seq))
        if seq.cache_entry is None:
            need += mem.adapter_need(seq.request.adapter, lora.bytes_of(seq.request.adapter))
        return need * mem.kv.block_tokens

    def release_tokens(self, seq: Sequence) -> int:
        hold = seq.kv_hold
        return hold.reserved * self.engine.memory.kv.block_tokens if hold is not None else 0
