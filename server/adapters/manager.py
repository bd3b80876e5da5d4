"""Everything the engine holds for adapters, behind the one interface the engine uses.

The engine asks four things: `acquire` a request's adapter (memory and a load), `may_start` it
under the LoRA mode, the LoRA side of each step (`steps`, step.py) and `release` it when
it ends. Requests name adapters by `AdapterRef` (made by `register`; `refs`, registry.py,
resolves names and counts requests in flight). The device cache and pool (gpu_lora) key on the
reference's `weights_id`, which `register` gives the adapter (`LoraAdapter.id`): a new id for
new weights, so rows cached for an adapter since unloaded are never taken for one registered
later under its name, and the id of the name already holding them for the same weights under
another name, so that they are one copy on the device. The host side (`host`, host.py: the
registered tensors, DoRA's scales on the device, the CPU workers' arena) keys on the same ids:
registrations by `AdapterRef.id`, what they compute with by `weights_id`; unregistering a
reference frees everything held for it and shared with no other registration. Names are
resolved once (registry.py); below that, nothing here looks an adapter up by name. Before that,
`open` (`reader`, reader.py) reads an adapter directory only once its rank passed the limit and
what it will occupy fits.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Protocol

import torch

from toppings.gpu_lora.cache import AdapterCache, CacheEntry
from toppings.gpu_lora.dora import BaseProjections
from toppings.gpu_lora.host_memory import ContentKey
from toppings.gpu_lora.kernels import select as select_lora_backend
from toppings.gpu_lora.lora_batch import HostLoraStats
from toppings.gpu_lora.peft.adapter import LoraAdapter
from toppings.gpu_lora.targets import LORA_TARGETS
from toppings.gpu_lora.trace import TraceRecorder
from toppings.server.adapters.host import AdapterHost
from toppings.server.adapters.host_served import HostServed
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


class AdapterRoom(Protocol):
    """The node's memory as the owner of eviction (server/memory/manager.py): it makes room for
    an adapter's load, so that the device cache then only allocates."""

    def make_adapter_room(
        self, adapter: LoraAdapter, keep: frozenset[int], prefetch: bool = False
    ) -> bool:
        """Evict until a load of `adapter` fits; whether it does. keep: ids of adapters of
        queued requests, evicted last; prefetch: a load no request waits for."""
        ...


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
        room: AdapterRoom,
        trace: TraceRecorder | None = None,
        base: BaseProjections | None = None,
    ):
        """config: the LoRA part of the engine's configuration; kernel, device: the runtime's
        LoRA kernel and device; max_step_tokens: the most tokens one step computes (the CPU
        workers size their buffers for it); cache: the device adapter cache (with its pool and
        loader), built with the node's memory (server/memory/build.py); room: that memory,
        which makes room before the cache allocates (the one owner of eviction); trace: each step's
        host LoRA calls and layers go to it (None: no tracing); base: the base model's
        projection weights, read when a DoRA adapter is opened (None: DoRA is refused)."""
        self.config = config
        self.mode_name = config.mode_on(device)  # `auto` picked
        self.mode = LORA_MODES[self.mode_name]
        kernels = select_lora_backend(kernel, device, dtype)  # raises before any worker starts
        self.host_stats = HostLoraStats()
        self.refs = AdapterRegistry()  # the registered adapters' references, requests in flight
        self.cache = cache
        self.room = room
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
        # Requests served on the host for want of device room (host_served.py), oldest first,
        # and counts since start: such admissions, and those moved to the device since.
        self._on_host: list[HostServed] = []
        self.num_host_served = 0
        self.num_promoted = 0

    def open(self, path: str, name: str) -> LoraAdapter:
        """Read the adapter directory at `path` as adapter `name` (AdapterReader.open)."""
        return self.reader.open(path, name)

    def register(self, adapter: LoraAdapter, content: ContentKey | None = None) -> AdapterRef:
        """Make a validated adapter servable (with the engine's lock held when the mode
        preloads; Engine.register_adapter says why not otherwise; registrations come one at a
        time, from the adapter thread); returns its new reference (409 when its name is
        registered). Content already held under another name is shared, not copied; a new copy
        is charged to the host budget (507 past it). `content`: the adapter's content key when
        the caller has it (None: made here)."""
        self.refs.check_free(adapter.name)  # a name taken meanwhile: `refs.add` refuses it below
        adapter, content, shared_weights_id = self.host.shared(adapter, content)
        nbytes = self.cache.charge(adapter)
        ref = AdapterRef.new(adapter.name, adapter.rank, nbytes, shared_weights_id)
        adapter = dataclasses.replace(adapter, id=ref.weights_id)  # every layer's key below
        self.host.add(adapter, content, ref)
        if self.mode.preload:
            # The ideal upper bound: every adapter on the device before any request, pinned.
            entry = None
            if self.room.make_adapter_room(adapter, frozenset()):
                entry = self.cache.acquire(adapter)
            if entry is None:
                self.unregister(ref)
                raise RequestError("the adapter cache is full", 507, INSUFFICIENT_STORAGE)
            entry.ticket.wait()
        try:
            self.refs.add(ref)
        except BaseException:
            self.unregister(ref)  # nothing held for a registration no name resolves to
            raise
        return ref

    def unregister(self, ref: AdapterRef) -> LoraAdapter | None:
        """Drop registration `ref` from the host, and its rows from the device unless another
        registration computes with them; returns its adapter as it was held."""
        if self.mode.preload and self.cache.holds(ref.weights_id):
            self.cache.release(ref.weights_id)  # this registration's pin
        held = self.unregister_host(ref)
        self.forget_rows(ref.weights_id)
        return held

    def unregister_host(self, ref: AdapterRef) -> LoraAdapter | None:
        """The host side of `unregister` alone (in a mode that does not preload: no pin to
        let go); its rows then go by `forget_rows`, on the engine thread."""
        held = self.host.lookup(ref)
        self.host.drop(ref)
        return held

    def forget_rows(self, weights_id: int) -> None:
        """Drop the device rows of `weights_id`, unless a registration still computes with
        them (then they stay, shown by its name)."""
        others = [a for a in self.host.registered() if a.id == weights_id]
        if others:
            self.cache.rename(weights_id, others[0].name)
        else:
            self.cache.forget(weights_id)

    # ---- per request (the engine thread) -----------------------------------------------------

    def make_room(self, ref: AdapterRef, queued: frozenset[AdapterRef]) -> bool:
        """Ask the memory (the one owner of eviction) to evict until the adapter's load fits,
        adapters of waiting requests (`queued`) last; whether it fits. Admission calls it
        before `acquire`."""
        return self.room.make_adapter_room(self._lookup(ref), _ids(queued))

    def acquire(self, ref: AdapterRef) -> CacheEntry | None:
        """Take a reference on the adapter and start its load if it is not on the device;
        None when the room is not there (`make_room` comes first: nothing is evicted here)."""
        return self.cache.acquire(self._lookup(ref))

    def _lookup(self, ref: AdapterRef) -> LoraAdapter:
        adapter = self.host.lookup(ref)
        if adapter is None:
            raise KeyError(f"adapter {ref.name!r} (id {ref.id}) is not registered")
        return adapter

    def prefetch(self, refs: list[AdapterRef], queued: frozenset[AdapterRef]) -> None:
        """Load the first of these adapters of queued requests that is not on the device, when
        the loader is idle (a prefetch never delays an admitted request's load) and it fits
        without evicting an adapter in use or wanted."""
        if self.mode.preload or not self.cache.keep_idle or not self.loader.idle():
            return  # without a cache nothing is prefetched (it would only be dropped)
        for ref in refs:
            adapter = self.host.lookup(ref)
            if adapter is not None and not self.cache.holds(ref.weights_id):
                if self.room.make_adapter_room(adapter, _ids(queued), prefetch=True):
                    self.cache.prefetch(adapter)
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

    def serve_on_host(self, ref: AdapterRef) -> HostServed | None:
        """A reference that computes adapter `ref` on the host, for a request admission found
        no device room for (host_served.py); None where the mode waits for room instead, and
        where the room is there but the pool must grow for it once the running load ends (a
        moment's wait: on a CPU device an adapter in the pool computes faster than on the
        host, which pays the framework's overhead per projection)."""
        adapter = self._lookup(ref)
        if not self.mode.host_workers:
            return None
        if self.cache.has_room(adapter) and self.cache.waits_for_loader(adapter):
            return None
        entry = HostServed(adapter, self.pool.config.num_layers)
        self._on_host.append(entry)
        self.num_host_served += 1
        return entry

    def promote(self, queued: Callable[[], frozenset[AdapterRef]]) -> None:
        """Move requests served on the host to the device, oldest first, while room is there
        without evicting an adapter in use or wanted by `queued()` (a prefetch's room: blocks
        no admitted request was promised) and the loader is idle (a move never delays an
        admitted request's load). The scheduler calls it each iteration."""
        if not self._on_host or not self.loader.idle():
            return
        keep = _ids(queued())
        while self._on_host:
            served = self._on_host[0]
            if not self.room.make_adapter_room(served.adapter, keep, prefetch=True):
                return
            entry = self.cache.acquire(served.adapter, promised=False)
            if entry is None:
                return
            served.device = entry
            del self._on_host[0]
            self.num_promoted += 1

    @property
    def num_on_host(self) -> int:
        """Requests served on the host now (not moved to the device yet)."""
        return len(self._on_host)

    def release(self, ref: AdapterRef, entry: CacheEntry | HostServed) -> None:
        """Drop a request's reference `entry` on adapter `ref`, taken by `acquire` or
        `serve_on_host`."""
        if isinstance(entry, HostServed) and entry.device is None:
            self._on_host.remove(entry)
            return
        self.cache.release(ref.weights_id)

    # ---- views for /stats and /metrics (any thread) -----------------------------------------

    def residency(self) -> tuple[list[str], list[str]]:
        """(resident, loading) adapter names on the device (every name of shared rows)."""
        names: dict[int, list[str]] = {}
        for adapter in self.host.registered():
            names.setdefault(adapter.id, []).append(adapter.name)
        resident, loading = [], []
        for weights_id, entry in list(self.cache.entries.items()):
            (resident if entry.ticket.done else loading).extend(names.get(weights_id, ()))
        return resident, loading

    def max_device_adapters(self) -> int:
        """How many adapters of the registered ones' mean charge the device's adapter memory
        holds when it holds nothing else: every registered one when that memory has no limit;
        adapters of the rank limit on every target when none is registered."""
        limit = self.cache.max_adapter_bytes()
        registered = self.host.registered()
        adapters = list({a.id: a for a in registered}.values())
        if limit is None:
            return len(registered)
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
