"""The LoRA side of requests and steps, as the engine loop and the model runner use it.

At submission, `lora_start` finds where an activated LoRA (aLoRA) starts to apply in a prompt
(before it, the KV is the base model's). Per step, `step` builds the forward pass's `LoraBatch`:
each request's cache entry gives where its adapter's layers live (device rows once loaded, the
host runner until then) and its DoRA scales; under on-demand-sync `wait_for_loads` stalls the
step before its forward pass, which itself never waits on a load.
"""

from __future__ import annotations

import torch

from toppings.gpu_lora.adapter_pool import AdapterPool
from toppings.gpu_lora.alora import activation_start, split_rows
from toppings.gpu_lora.brief import brief
from toppings.gpu_lora.cache import CacheEntry
from toppings.gpu_lora.kernels import LoraBackend
from toppings.gpu_lora.lora_batch import HostLoraStats, LoraBatch
from toppings.gpu_lora.trace import TraceRecorder
from toppings.server.adapters.host import AdapterHost
from toppings.server.lora_modes import LoraMode
from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.request import RequestError


class AdapterStep:
    """Builds each step's LoRA side for one engine (see the module docstring)."""

    def __init__(
        self,
        pool: AdapterPool,
        kernels: LoraBackend,
        mode: LoraMode,
        host: AdapterHost,
        host_stats: HostLoraStats,
        trace: TraceRecorder | None = None,
    ):
        """pool, kernels: the device adapter pool and the LoRA kernels; mode: the LoRA mode
        (whether a step stalls for loads); host: the registered adapters (tensors, host runner,
        DoRA scales); host_stats: counts the host LoRA calls; trace: each step's host LoRA
        calls and layers go to it (None: no tracing)."""
        self.pool = pool
        self.kernels = kernels
        self.mode = mode
        self.host = host
        self.host_stats = host_stats
        self._trace = trace
        # A decode step whose adapters, rows and pool tables are the last one's (one stream,
        # or a batch whose members did not change) runs the last LoraBatch again: building it
        # is a dozen small tensors and the native step's structs (see `_decode_key`).
        self._last: tuple[tuple, LoraBatch, tuple] | None = None

    def is_activated(self, ref: AdapterRef | None) -> bool:
        """Whether `ref` is an activated LoRA (its KV before `lora_start` is the base model's)."""
        adapter = self.host.lookup(ref) if ref is not None else None
        return adapter is not None and bool(adapter.invocation_tokens)

    def lora_start(self, ref: AdapterRef | None, prompt_ids: list[int]) -> int:
        """The first prompt position adapter `ref` applies to: 0, or for an activated LoRA
        where the last occurrence of its invocation sequence starts (gpu_lora/alora.py). A
        prompt without that sequence is a 400 naming it."""
        adapter = self.host.lookup(ref) if ref is not None else None
        if adapter is None or not adapter.invocation_tokens:
            return 0
        start = activation_start(prompt_ids, adapter.invocation_tokens)
        if start is None:
            raise RequestError(
                f"adapter {ref.name!r} is an activated LoRA: the prompt must contain its "
                f"invocation sequence, token ids {brief(adapter.invocation_tokens)} "
                "(alora_invocation_tokens)"
            )
        return start

    def step(
        self,
        entries: list[CacheEntry | None],
        seg_starts: list[int],
        is_prefill: bool,
        positions: list[int] | None = None,
        lora_starts: list[int] | None = None,
    ) -> LoraBatch | None:
        """The LoRA side of one forward pass over B requests (None: no request has an adapter).

        entries: each request's cache entry (None: base model); seg_starts: B + 1 token offsets;
        positions: each request's first position in this step; lora_starts: where each one's
        adapter starts to apply (`lora_start`; None: everywhere). A prefill's rows before that
        get no delta (a decode's row always comes after it).
        """
        if is_prefill and lora_starts is not None and any(lora_starts):
            entries, seg_starts = split_rows(entries, seg_starts, positions, lora_starts)
        if not any(entries):
            return None
        adapters = [e.resident if e else None for e in entries]
        dora = [self.host.dora_scales(e.resident.id) if e else None for e in entries]
        key = None
        if (
            not is_prefill
            and self._trace is None
            and all(e is None or e.ticket.done for e in entries)
        ):
            key = self._decode_key(adapters, seg_starts, dora)
            if self._last is not None and self._last[0] == key:
                return self._last[1]
        batch = LoraBatch(
            self.pool,
            self.kernels,
            adapters,
            seg_starts,
            is_prefill,
            tickets=[e.ticket if e else None for e in entries],
            dora=dora,
            host=self.host.runner,
            host_stats=self.host_stats,
            trace=self._trace,
        )
        self._last = (key, batch, self._tables()) if key is not None else None
        return batch

    def _tables(self) -> tuple[torch.Tensor, ...]:
        return (*self.pool.lora_a.values(), *self.pool.lora_b.values())

    def _decode_key(self, adapters: list, seg_starts: list[int], dora: list) -> tuple:
        """What a decode step's LoraBatch is made of: a step of the same key may run the last
        one again (every adapter resident, no trace; the last batch holds its tables, so their
        ids are not reused while it is kept)."""
        tables = tuple(id(t) for t in self._tables())
        threads = torch.get_num_threads()  # the governor's (the native step keeps its own)
        return tuple(adapters), tuple(seg_starts), tuple(id(d) for d in dora), tables, threads

    def has_dora(self, entries: list[CacheEntry | None]) -> bool:
        """Whether any of these requests' adapters is a DoRA adapter (decode graphs do not
        apply DoRA's scales: such a step runs eagerly)."""
        return any(
            e is not None and self.host.dora_scales(e.resident.id) is not None for e in entries
        )

    def wait_for_loads(self, entries: list[CacheEntry | None]) -> None:
        """Under a mode that stalls for loads (on-demand-sync), wait until every one of a
        step's adapters is resident: the engine calls it before the step's forward pass, which
        never waits on a load; raises when a load failed (the step's requests fail)."""
        if not self.mode.stall_for_load:
            return
        for entry in entries:
            if entry is not None and not entry.ticket.done:
                entry.ticket.wait()
                if entry.ticket.error is not None:
                    raise RuntimeError(f"adapter load failed: {entry.ticket.error}")
