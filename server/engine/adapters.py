"""Everything the engine holds for adapters, behind the one interface the engine uses.

Registered adapters live in host memory (their `LoraAdapter` tensors and, with CPU workers, the
shared-memory `HostRepository` the workers read), one copy per content charged to a host budget
(gpu_lora/host_memory.py). The device side is the adapter pool, filled by
the pipelined loader and governed by the byte-budget cache. Layers not yet on the device are
computed by `host`: the CPU worker pool, or in-process when the server runs no workers.

The engine asks four things: `acquire` a request's adapter (memory and a load), `may_start` it
under the LoRA mode, `step` (the LoRA side of one forward pass) and `release` it when it ends.
Requests name adapters by `AdapterRef` (made by `register`; `refs`, adapter_registry.py,
resolves names and counts requests in flight). The device cache and pool (gpu_lora) key on the
reference's id, which `register` gives the adapter (`LoraAdapter.id`): rows cached for an
adapter since unloaded are never taken for one registered later under its name. The host side
(the registered tensors, DoRA's scales on the device by id, the CPU workers' arena by name)
holds one registration per name, and unregistering frees everything held for it.
Before that, `open` reads an adapter directory only once its shapes passed the rank limit
(`--max-lora-rank`) and what it will occupy fits: in the device pool (its real row layout), in
the node's memory when adapters are charged to KV blocks, and in the CPU workers' arena.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import torch

from toppings.gpu_lora.adapter_pool import AdapterPool
from toppings.gpu_lora.alora import activation_start, split_rows
from toppings.gpu_lora.cache import AdapterCache, CacheEntry
from toppings.gpu_lora.dora import BaseProjections, DoraScales, dora_scales
from toppings.gpu_lora.host_lora import HostLora, HostLoraRunner
from toppings.gpu_lora.host_memory import (
    DEFAULT_BUDGET_FRACTION,
    HostAdapterMemory,
    HostMemoryFull,
    default_budget_bytes,
)
from toppings.gpu_lora.kernels import select as select_lora_backend
from toppings.gpu_lora.lora_batch import HostLoraStats, LoraBatch
from toppings.gpu_lora.peft_format import (
    AdapterError,
    AdapterShape,
    LoraAdapter,
    inspect_peft_adapter,
    load_peft_adapter,
)
from toppings.gpu_lora.targets import ATTN_PROJECTIONS, LORA_TARGETS
from toppings.gpu_lora.trace import TraceRecorder
from toppings.server.config import LoraConfig
from toppings.server.engine.adapter_registry import AdapterRegistry
from toppings.server.lora_modes import LORA_MODES
from toppings.server.model.config import ModelConfig
from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.errors import INSUFFICIENT_STORAGE
from toppings.server.requests.request import RequestError

log = logging.getLogger(__name__)

HOST_REPOSITORY_BYTES = 4 << 30  # shared arena for the workers (sparse: only used pages count)
DEFAULT_MAX_LORA_RANK = 256  # --max-lora-rank 0 when adapters have no budget
MAX_DERIVED_LORA_RANK = 512  # the most a limit derived from a budget allows


def derived_max_rank(pool: AdapterPool, budget_bytes: int | None) -> int:
    """--max-lora-rank 0: the largest power of two at which an adapter on the projection of
    smallest rows, in every layer (the least any adapter of that rank occupies), fits in
    `budget_bytes`, at most MAX_DERIVED_LORA_RANK and at least 1; DEFAULT_MAX_LORA_RANK
    without a budget."""
    if budget_bytes is None:
        return DEFAULT_MAX_LORA_RANK
    smallest = min(pool.row_bytes(m) for m in LORA_TARGETS)
    rank = 1
    while 2 * rank <= MAX_DERIVED_LORA_RANK and 2 * rank * smallest <= budget_bytes:
        rank *= 2
    return rank


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
        self.max_step_tokens = max_step_tokens
        self.model_config = model_config
        self.mode = LORA_MODES[config.lora_mode]
        self.kernels = select_lora_backend(kernel, device, dtype)
        self.host_stats = HostLoraStats()
        self._trace = trace
        self.registry: dict[str, LoraAdapter] = {}  # the registered adapters' tensors
        self.refs = AdapterRegistry()  # their references and in-flight requests
        self.base = base
        self.dtype = dtype
        # DoRA adapters' scales on the device, by adapter id (small: two [L, H_out] per module)
        self._dora: dict[int, DoraScales] = {}
        self.cache = cache
        self.pool = cache.pool
        self.loader = cache.loader
        self.host: HostLoraRunner = HostLora(self.registry)
        # The largest rank served (a runtime value: the configured 0 stays in the config).
        self.max_lora_rank = config.max_lora_rank or derived_max_rank(
            self.pool, cache.max_adapter_bytes()
        )
        log.info("adapters up to rank %d (--max-lora-rank)", self.max_lora_rank)
        self.host_memory = HostAdapterMemory(config.adapter_host_bytes or default_budget_bytes())
        log.info("adapters may hold %.1f MiB of host memory (--adapter-host-bytes%s)",
                 self.host_memory.budget_bytes / 2**20,
                 "" if config.adapter_host_bytes else f"; default {DEFAULT_BUDGET_FRACTION:.0%} "
                 "of this machine's memory")  # fmt: skip
        self.repository = self.workers = None
        if self.mode.host_workers and config.num_cpu_workers:
            self._start_workers(dtype)

    def _start_workers(self, dtype: torch.dtype) -> None:
        from toppings.cpu_lora.pool import CpuLoraPool
        from toppings.cpu_lora.repository import HostRepository

        host_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        self.repository = HostRepository.create(
            self.model_config, HOST_REPOSITORY_BYTES, dtype=host_dtype
        )
        try:
            self.workers = CpuLoraPool(
                self.repository,
                self.model_config,
                self.config.num_cpu_workers,
                cores=list(self.config.cpu_cores) or None,
                max_tokens=self.max_step_tokens,
                spin_us=self.config.cpu_spin_us,
            )
        except BaseException:
            self.repository.close()
            self.repository.unlink()
            raise
        self.host = self.workers
        log.info("%d CPU LoRA workers, %d tokens per core", self.workers.num_workers,
                 self.workers.tokens_per_core)  # fmt: skip

    def open(self, path: str, name: str) -> LoraAdapter:
        """Read the adapter directory at `path` as adapter `name`, once its config and its
        safetensors header (no tensor read yet) show a rank within `max_lora_rank` and sizes
        that fit. Raises AdapterError (a bad adapter, or its rank above the limit: a 400) or
        RequestError 507 (larger than the memory it would live in)."""
        shape = inspect_peft_adapter(path, self.model_config)
        if shape.max_rank > self.max_lora_rank:
            raise AdapterError(
                f"{path}: rank {shape.max_rank} is above this server's limit of "
                f"{self.max_lora_rank} (--max-lora-rank)"
            )
        self._check_room(name, shape)
        adapter = load_peft_adapter(path, self.model_config, name=name)
        if adapter.is_dora:
            adapter = dataclasses.replace(adapter, dora=self._dora_scales(adapter))
        return adapter

    def _dora_scales(self, adapter: LoraAdapter) -> DoraScales:
        """The DoRA scales of `adapter`, from the base model's weights (read here, once)."""
        if self.base is None:
            raise AdapterError(f"adapter {adapter.name!r} is a DoRA adapter; this server was "
                               "started without the base weights DoRA needs")  # fmt: skip
        return dora_scales(adapter.name, adapter.scale, adapter.weights, adapter.magnitudes,
                           self.base, self.model_config.num_layers)  # fmt: skip

    def _check_room(self, name: str, shape: AdapterShape) -> None:
        """507 when the adapter's charges exceed the whole memory it would be charged to."""
        device_bytes = self.pool.bytes_for(shape.rank, shape.modules)
        limit = self.cache.max_adapter_bytes()
        if limit is not None and device_bytes > limit:
            raise RequestError(
                f"adapter {name!r} needs {device_bytes} bytes of adapter memory (rank "
                f"{shape.rank} on {', '.join(shape.modules)} in all "
                f"{self.model_config.num_layers} layers), more than the whole adapter budget "
                f"of {limit} bytes",
                507,
                INSUFFICIENT_STORAGE,
            )
        if self.repository is not None:
            host_bytes = self.repository.block_bytes_for(shape.rank, shape.targeted)
            if host_bytes > self.repository.free_bytes:
                raise RequestError(
                    f"adapter {name!r} needs {host_bytes} bytes in the CPU workers' shared "
                    f"arena, which has {self.repository.free_bytes} of its "
                    f"{self.repository.capacity_bytes} bytes free",
                    507,
                    INSUFFICIENT_STORAGE,
                )

    def register(self, adapter: LoraAdapter) -> AdapterRef:
        """Make a validated adapter servable (called with the engine's lock held); returns its
        new reference. Content already held under another name is shared, not copied; a new
        copy is charged to the host budget (507 past it)."""
        if adapter.name in self.registry:
            raise RequestError(f"adapter {adapter.name!r} is already loaded", 409, "conflict")
        adapter, digest = self.host_memory.shared(adapter)
        shares = self.host_memory.name_of_copy(digest)  # a name holding the same content
        host_bytes = adapter.num_bytes
        if self.repository is not None:
            host_bytes += self.repository.block_bytes(adapter)
        try:
            self.host_memory.charge(adapter, digest, host_bytes)
        except HostMemoryFull as exc:
            raise RequestError(str(exc), 507, INSUFFICIENT_STORAGE) from None
        try:
            if self.repository is not None:
                self._add_to_repository(adapter, shares)
        except BaseException:
            self.host_memory.release(adapter.name)
            raise
        if self.pool.device.type == "cuda" and shares is None:
            # Pinned host copies: the loader's copies then run asynchronously on its stream.
            for key, (a, b) in adapter.weights.items():
                adapter.weights[key] = (a.pin_memory(), b.pin_memory())
        ref = AdapterRef.new(adapter.name, adapter.rank, self.cache.charge(adapter))
        adapter = dataclasses.replace(adapter, id=ref.id)  # what the device cache keys it by
        self.registry[adapter.name] = adapter
        if adapter.dora is not None:
            self._dora[adapter.id] = adapter.dora.to(self.pool.device, self.dtype)
        if self.mode.preload:
            # The ideal upper bound: every adapter on the device before any request, pinned.
            entry = self.cache.acquire(adapter)
            if entry is None:
                self.unregister(adapter.name)
                raise RequestError("the adapter cache is full", 507, INSUFFICIENT_STORAGE)
            entry.ticket.wait()
        self.refs.add(ref)
        return ref

    def _add_to_repository(self, adapter: LoraAdapter, shares: str | None) -> None:
        """Copy the adapter into the workers' shared arena, or point it at the block of
        `shares` (the same content); no room there is a 507 (the server keeps serving the
        adapters it has)."""
        from toppings.cpu_lora.repository import RepositoryFullError
        from toppings.cpu_lora.shm import SharedMemoryFull

        try:
            if shares is not None:
                self.repository.add_alias(adapter, of=shares)
            else:
                self.repository.add(adapter)
        except (SharedMemoryFull, RepositoryFullError) as exc:
            raise RequestError(
                f"cannot load adapter {adapter.name!r}: {exc}", 507, INSUFFICIENT_STORAGE
            ) from None

    def unregister(self, name: str) -> None:
        """Drop the adapter registered as `name` from the device and the host."""
        adapter_id = self.registry[name].id
        if self.mode.preload and self.cache.holds(adapter_id):
            self.cache.release(adapter_id)  # the registration pin
        self.cache.forget(adapter_id)
        if self.repository is not None and self.repository.lookup(name) is not None:
            self.repository.remove(name)
        del self.registry[name]
        self._dora.pop(adapter_id, None)
        self.host_memory.release(name)

    def _adapter(self, ref: AdapterRef) -> LoraAdapter:
        """The registered adapter of this reference (KeyError once it was unregistered, even
        if another one holds its name now)."""
        adapter = self.registry.get(ref.name)
        if adapter is None or adapter.id != ref.id:
            raise KeyError(f"adapter {ref.name!r} (id {ref.id}) is not registered")
        return adapter

    # ---- per request and per step (the engine thread) -----------------------------------------

    def acquire(self, ref: AdapterRef, queued: frozenset[AdapterRef]) -> CacheEntry | None:
        """Take a reference on the adapter and start its load if it is not on the device;
        None when no adapter memory is free until a running request ends. `queued`: adapters of
        waiting requests, which eviction spares."""
        return self.cache.acquire(self._adapter(ref), _ids(queued))

    def prefetch(self, refs: list[AdapterRef], queued: frozenset[AdapterRef]) -> None:
        """Load the first of these adapters of queued requests that is not on the device, when
        the loader is idle (a prefetch never delays an admitted request's load) and it fits
        without evicting an adapter in use or wanted."""
        if self.mode.preload or not self.loader.idle():
            return
        for ref in refs:
            adapter = self.registry.get(ref.name)
            if adapter is not None and adapter.id == ref.id and not self.cache.holds(ref.id):
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
        if ref is None or self.cache.holds(ref.id):
            return False
        need = self.bytes_of(ref)
        if self.cache.freeable_bytes() >= need or held is None or held == ref:
            return False
        entry = self.cache.entries.get(held.id)
        if entry is None or entry.refcount != 1:
            return False
        return self.cache.freeable_bytes(extra=held.id) >= need

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
        self.cache.release(ref.id)

    def is_activated(self, ref: AdapterRef | None) -> bool:
        """Whether `ref` is an activated LoRA (its KV before `lora_start` is the base model's)."""
        adapter = self.registry.get(ref.name) if ref is not None else None
        return adapter is not None and bool(adapter.invocation_tokens)

    def lora_start(self, ref: AdapterRef | None, prompt_ids: list[int]) -> int:
        """The first prompt position adapter `ref` applies to: 0, or for an activated LoRA
        where the last occurrence of its invocation sequence starts (gpu_lora/alora.py). A
        prompt without that sequence is a 400 naming it."""
        name = ref.name if ref is not None else None
        adapter = self.registry.get(name) if name is not None else None
        if adapter is None or not adapter.invocation_tokens:
            return 0
        start = activation_start(prompt_ids, adapter.invocation_tokens)
        if start is None:
            raise RequestError(
                f"adapter {name!r} is an activated LoRA: the prompt must contain its invocation "
                f"sequence, token ids {list(adapter.invocation_tokens)} (alora_invocation_tokens)"
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
        return LoraBatch(
            self.pool,
            self.kernels,
            [e.resident if e else None for e in entries],
            seg_starts,
            is_prefill,
            tickets=[e.ticket if e else None for e in entries],
            dora=[self._dora.get(e.resident.id) if e else None for e in entries],
            host=self.host,
            host_stats=self.host_stats,
            trace=self._trace,
        )

    def has_dora(self, entries: list[CacheEntry | None]) -> bool:
        """Whether any of these requests' adapters is a DoRA adapter (decode graphs do not
        apply DoRA's scales: such a step runs eagerly)."""
        return any(e is not None and e.resident.id in self._dora for e in entries)

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

    # ---- views for /stats and /metrics (any thread) -----------------------------------------

    def residency(self) -> tuple[list[str], list[str]]:
        """(resident, loading) adapter names on the device."""
        entries = list(self.cache.entries.values())
        resident = [e.resident.name for e in entries if e.ticket.done]
        return resident, [e.resident.name for e in entries if not e.ticket.done]

    def max_device_adapters(self) -> int:
        """How many adapters of the registered ones' mean charge the device's adapter memory
        holds when it holds nothing else: every registered one when that memory has no limit;
        adapters of the rank limit on every target when none is registered."""
        limit = self.cache.max_adapter_bytes()
        adapters = list(self.registry.values())
        if limit is None:
            return len(adapters)
        if adapters:
            mean = sum(self.cache.charge(a) for a in adapters) / len(adapters)
        else:
            mean = self.pool.bytes_for(self.max_lora_rank, LORA_TARGETS)
        return int(limit // mean) if mean > 0 else 0

    def references(self) -> int:
        """References held by queued and running requests (and cached mode's pins)."""
        return sum(e.refcount for e in list(self.cache.entries.values()))

    def worker_stats(self) -> list[dict]:
        return [] if self.workers is None else self.workers.workers_info()

    def close(self) -> None:
        """Stop the loader and the workers and unlink the shared arena (idempotent)."""
        self.loader.close()
        if self.workers is not None:
            self.workers.close()
        if self.repository is not None:
            self.repository.close()
            self.repository.unlink()
            self.repository = None


def _ids(refs: frozenset[AdapterRef]) -> frozenset[int]:
    """The ids the device cache knows these adapters by."""
    return frozenset(r.id for r in refs)


class CheckpointProjections:
    """`BaseProjections` over a checkpoint's tensors by Hugging Face name (server.model.weights:
    each read from its file when asked for), for DoRA's scales."""

    def __init__(self, weights: Mapping[str, torch.Tensor]):
        self.weights = weights

    def projection(self, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        parent = "self_attn" if module in ATTN_PROJECTIONS else "mlp"
        prefix = f"model.layers.{layer}.{parent}.{module}."
        return self.weights[prefix + "weight"], self.weights.get(prefix + "bias")
