"""Everything the engine holds for adapters, behind the one interface the engine uses.

The engine asks four things: `acquire` a request's adapter (memory and a load), `may_start` it
under the LoRA mode, the LoRA side of each step (`steps`, adapter_step.py) and `release` it when
it ends. Requests name adapters by `AdapterRef` (made by `register`; `refs`, adapter_registry.py,
resolves names and counts requests in flight). The device cache and pool (gpu_lora) key on the
reference's `weights_id`, which `register` gives the adapter (`LoraAdapter.id`): a new id for
new weights, so rows cached for an adapter since unloaded are never taken for one registered
later under its name, and the id of the name already holding them for the same weights under
another name, so that they are one copy on the device. The host side (`host`, adapter_host.py:
the registered tensors, DoRA's scales on the device, the CPU workers' arena by name) holds one
registration per name, and unregistering frees everything held for it and shared with no other
name. Before that, `open` (`reader`, adapter_reader.py) reads an adapter directory only once
its rank passed the limit and what it will occupy fits.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from toppings.gpu_lora.cache import AdapterCache, CacheEntry
from toppings.gpu_lora.dora import BaseProjections
from toppings.gpu_lora.kernels import select as select_lora_backend
from toppings.gpu_lora.lora_batch import HostLoraStats
from toppings.gpu_lora.peft_format import LoraAdapter
from toppings.gpu_lora.targets import LORA_TARGETS
from toppings.gpu_lora.trace import TraceRecorder
from toppings.server.adapters.host import AdapterHost
from toppings.server.adapters.reader import AdapterReader, derived_max_rank
from toppings.server.adapters.registry import AdapterRegistry
from toppings.server.adapters.step import AdapterStep
from toppings.server.config import LoraConfig
from toppings.server.lora_modes import LORA_MODES
from toppings.server.model.config import ModelConfig
from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.errors import INSUFFICIENT_STORAGE
from toppings.server.requests.request import RequestError

log = logging.getLogger(__name__)


class AdapterManager:
    """Registry, device cache and host compute of one engine's adapters."""

    def __init__(
        self,
        config: LoraConfig,
        kernel: str,
        device: str,
        max_step_tokens: int,
        model_config: ModelConfig,
        dtype: torch.dtype,
        cache: AdapterCache,
        trace: TraceRecorder | None = None,
        base: BaseProjections | None = None,
    ):
        """config: the LoRA part of the engine's configuration; kernel, device: the runtime's
        LoRA kernel and device; max_step_tokens: the most tokens one step computes (the CPU
        workers size their buffers for it); cache: the device adapter cache (with its pool and
        loader), built with the node's memory (server/memory/build.py); trace: each step's
        host LoRA calls and layers go to it (None: no tracing); base: the base model's
        projection weights, read when a DoRA adapter is opened (None: DoRA is refused)."""
        self.config = config
        self.mode = LORA_MODES[config.lora_mode]
        kernels = select_lora_backend(kernel, device, dtype)  # raises before any worker starts
        self.host_stats = HostLoraStats()
        self.refs = AdapterRegistry()  # the registered adapters' references, requests in flight
        self.cache = cache
        self.pool = cache.pool
        self.loader = cache.loader
        # The largest rank served (a runtime value: the configured 0 stays in the config).
        self.max_lora_rank = config.max_lora_rank or derived_max_rank(
            self.pool, cache.max_adapter_bytes()
        )
        log.info("adapters up to rank %d (--max-lora-rank)", self.max_lora_rank)
        self.host = AdapterHost(
            config, model_config, dtype, self.pool.device, max_step_tokens, self.mode.host_workers
        )
        self.reader = AdapterReader(model_config, self.max_lora_rank, cache, self.host, base)
        self.steps = AdapterStep(self.pool, kernels, self.mode, self.host, self.host_stats, trace)

    def open(self, path: str, name: str) -> LoraAdapter:
        """Read the adapter directory at `path` as adapter `name` (AdapterReader.open)."""
        return self.reader.open(path, name)

    def register(self, adapter: LoraAdapter, digest: str | None = None) -> AdapterRef:
        """Make a validated adapter servable (with the engine's lock held when the mode
        preloads; Engine.register_adapter says why not otherwise); returns its new reference.
        Content already held under another name is shared, not copied; a new copy is charged
        to the host budget (507 past it). `digest`: the adapter's content digest when the
        caller has it (None: computed here)."""
        adapter, shared_weights_id = self.host.hold(adapter, digest)
        nbytes = self.cache.charge(adapter)
        ref = AdapterRef.new(adapter.name, adapter.rank, nbytes, shared_weights_id)
        adapter = dataclasses.replace(adapter, id=ref.weights_id)  # the device cache's key
        self.host.add(adapter, ref)
        if self.mode.preload:
            # The ideal upper bound: every adapter on the device before any request, pinned.
            entry = self.cache.acquire(adapter)
            if entry is None:
                self.unregister(adapter.name)
                raise RequestError("the adapter cache is full", 507, INSUFFICIENT_STORAGE)
            entry.ticket.wait()
        self.refs.add(ref)
        return ref

    def unregister(self, name: str) -> LoraAdapter:
        """Drop the adapter registered as `name` from the host, and from the device unless
        another registered name computes with the same rows; returns it as it was held."""
        held = self.host.registry[name]
        weights_id = held.id
        if self.mode.preload and self.cache.holds(weights_id):
            self.cache.release(weights_id)  # this name's registration pin
        others = [n for n in self.host.names_of(weights_id) if n != name]
        if others:
            self.cache.rename(weights_id, others[0])  # its rows stay, under a name still held
        else:
            self.cache.forget(weights_id)
        self.host.drop(name)
        return held

    # ---- per request (the engine thread) -----------------------------------------------------

    def acquire(self, ref: AdapterRef, queued: frozenset[AdapterRef]) -> CacheEntry | None:
        """Take a reference on the adapter and start its load if it is not on the device;
        None when no adapter memory is free until a running request ends. `queued`: adapters of
        waiting requests, which eviction spares."""
        adapter = self.host.lookup(ref)
        if adapter is None:
            raise KeyError(f"adapter {ref.name!r} (id {ref.id}) is not registered")
        return self.cache.acquire(adapter, _ids(queued))

    def prefetch(self, refs: list[AdapterRef], queued: frozenset[AdapterRef]) -> None:
        """Load the first of these adapters of queued requests that is not on the device, when
        the loader is idle (a prefetch never delays an admitted request's load) and it fits
        without evicting an adapter in use or wanted."""
        if self.mode.preload or not self.loader.idle():
            return
        for ref in refs:
            adapter = self.host.lookup(ref)
            if adapter is not None and not self.cache.holds(ref.weights_id):
                self.cache.prefetch(adapter, _ids(queued))
                return

    def registered(self) -> list[AdapterRef]:
        """Every registered adapter's reference."""
        return self.refs.refs()

    def bytes_of(self, ref: AdapterRef | None) -> int:
        """Device bytes an adapter is charged (0 for the base model)."""
        return 0 if ref is None else ref.nbytes

    def fits_if_released(self, ref: AdapterRef | None, held: AdapterRef | None) -> bool:
        """Whether adapter `ref` misses device memory now but would find it if the one
        reference a request holds on `held` were dropped."""
        if ref is None or self.cache.holds(ref.weights_id):
            return False
        need = self.bytes_of(ref)
        if self.cache.freeable_bytes() >= need or held is None or held == ref:
            return False
        entry = self.cache.entries.get(held.weights_id)
        if entry is None or entry.refcount != 1:
            return False
        return self.cache.freeable_bytes(extra=held.weights_id) >= need

    def may_start(self, entry: CacheEntry | None) -> bool:
        """Whether a request holding `entry` may be prefilled now under the LoRA mode; raises
        when its adapter's load failed and the mode waits for whole adapters (the scheduler
        fails that request alone)."""
        if entry is not None and self.mode.wait_for_load and entry.ticket.error is not None:
            raise RuntimeError(f"loading adapter {entry.resident.name!r} failed: "
                               f"{entry.ticket.error}")  # fmt: skip
        return entry is None or not self.mode.wait_for_load or entry.ticket.done

    def release(self, ref: AdapterRef) -> None:
        """Drop a request's reference taken by `acquire`."""
        self.cache.release(ref.weights_id)

    # ---- views for /stats and /metrics (any thread) -----------------------------------------

    def residency(self) -> tuple[list[str], list[str]]:
        """(resident, loading) adapter names on the device (every name of shared rows)."""
        names: dict[int, list[str]] = {}
        for name, adapter in list(self.host.registry.items()):
            names.setdefault(adapter.id, []).append(name)
        resident, loading = [], []
        for weights_id, entry in list(self.cache.entries.items()):
            (resident if entry.ticket.done else loading).extend(names.get(weights_id, ()))
        return resident, loading

    def max_device_adapters(self) -> int:
        """How many adapters of the registered ones' mean charge the device's adapter memory
        holds when it holds nothing else: every registered one when that memory has no limit;
        adapters of the rank limit on every target when none is registered."""
        limit = self.cache.max_adapter_bytes()
        adapters = list({a.id: a for a in list(self.host.registry.values())}.values())
        if limit is None:
            return len(self.host.registry)
        if adapters:
            mean = sum(self.cache.charge(a) for a in adapters) / len(adapters)
        else:
            mean = self.pool.bytes_for(self.max_lora_rank, LORA_TARGETS)
        return int(limit // mean) if mean > 0 else 0

    def references(self) -> int:
        """References held by queued and running requests (and cached mode's pins)."""
        return sum(e.refcount for e in list(self.cache.entries.values()))

    def close(self) -> None:
        """Stop the loader and the workers and unlink the shared arena (idempotent)."""
        self.loader.close()
        self.host.close()


def _ids(refs: frozenset[AdapterRef]) -> frozenset[int]:
    """The ids the device cache knows these adapters by."""
    return frozenset(r.weights_id for r in refs)
