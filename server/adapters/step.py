"""The LoRA side of requests and steps, as the engine loop and the model runner use it.

At submission, `lora_start` finds where an activated LoRA (aLoRA) starts to apply in a prompt
(before it, the KV is the base model's). Per step, `step` builds the forward pass's `LoraBatch`:
each request's cache entry gives where its adapter's layers live (device rows once loaded, the
host runner until then) and its DoRA scales; under on-demand-sync `wait_for_loads` stalls the
step before its forward pass, which itself never waits on a load.
"""

from __future__ import annotations

import itertools

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
        # A decode step whose rows are the last one's (the decode batch's generation, which
        # moves whenever its requests do: server/engine/decode_batch.py) over the same pool
        # (its generation) and thread count runs the last LoraBatch again: building it is a
        # dozen small tensors and the native step's structs. Kept with its key.
        self._last: tuple[tuple, LoraBatch] | None = None
        self._versions = itertools.count(1)  # of the LoraBatches that may serve several steps

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
        generation: int | None = None,
    ) -> LoraBatch | None:
        """The LoRA side of one forward pass over B requests (None: no request has an adapter).

        entries: each request's cache entry (None: base model); seg_starts: B + 1 token offsets;
        positions: each request's first position in this step; lora_starts: where each one's
        adapter starts to apply (`lora_start`; None: everywhere). A prefill's rows before that
        get no delta (a decode's row always comes after it). generation: a decode step's rows'
        generation (`DecodeBatch.generation`): a step of the last one's runs the LoraBatch built
        then, where every adapter of it was resident (None: built for this step alone).
        """
        if is_prefill and lora_starts is not None and any(lora_starts):
            entries, seg_starts = split_rows(entries, seg_starts, positions, lora_starts)
        if not any(entries):
            return None
        key = None
        if not is_prefill and generation is not None and self._trace is None:
            key = (generation, self.pool.generation, torch.get_num_threads())
            if self._last is not None and self._last[0] == key:
                return self._last[1]
            if not all(e is None or e.ticket.done for e in entries):
                key = None  # a loading adapter's rows change layer by layer: this step's
        batch = LoraBatch(
            self.pool,
            self.kernels,
            [e.resident if e else None for e in entries],
            seg_starts,
            is_prefill,
            tickets=[e.ticket if e else None for e in entries],
            dora=[self.host.dora_scales(e.resident.id) if e else None for e in entries],
            host=self.host.runner,
            host_stats=self.host_stats,
            trace=self._trace,
            version=next(self._versions) if key is not None else None,
        )
        self._last = (key, batch) if key is not None else None
        return batch

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
