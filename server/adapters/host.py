"""What a registered adapter holds outside the device cache, one registration per name.

Registered adapters live in host memory: their `LoraAdapter` tensors, one copy per content
charged to a host budget (gpu_lora/host_memory.py), and with CPU workers a block in the shared
`HostRepository` arena the workers read (an alias of the block of a name with the same content).
Layers not yet on the device are computed by `runner`: the CPU worker pool, or in-process
(`HostLora` over the registered tensors) when the server runs no workers. A DoRA adapter's
scales are copied to the device once, at registration, by weights id. Names registered with the
same weights share all of it (tensors, arena block, DoRA scales) and the id the device cache
holds their rows under (`AdapterRef.weights_id`). Registering is two calls (`hold`, then `add`
once the adapter has its reference); `drop` frees everything held for a name, and what it
shared with no other name left. The reference, the device charge and the load are adapters.py's.
"""

from __future__ import annotations

import logging

import torch

from toppings.gpu_lora.dora import DoraScales
from toppings.gpu_lora.host_lora import HostLora, HostLoraRunner
from toppings.gpu_lora.host_memory import (
    DEFAULT_BUDGET_FRACTION,
    HostAdapterMemory,
    HostMemoryFull,
    default_budget_bytes,
)
from toppings.gpu_lora.peft_format import AdapterShape, LoraAdapter
from toppings.server.config import LoraConfig
from toppings.server.model.config import ModelConfig
from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.errors import INSUFFICIENT_STORAGE
from toppings.server.requests.request import RequestError

log = logging.getLogger(__name__)

HOST_REPOSITORY_BYTES = 4 << 30  # shared arena for the workers (sparse: only used pages count)


class AdapterHost:
    """The registered adapters' tensors, host budget, CPU workers and DoRA scales."""

    def __init__(
        self,
        config: LoraConfig,
        model_config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_step_tokens: int,
        use_workers: bool,
    ):
        """config: the LoRA part of the engine's configuration (host budget, CPU workers);
        dtype, device: the model's (DoRA's scales go there; a CUDA device gets pinned host
        copies); max_step_tokens: the most tokens one step computes (the CPU workers size their
        buffers for it); use_workers: whether the LoRA mode computes on CPU workers (started
        when `config.num_cpu_workers` is not 0)."""
        self.model_config = model_config
        self.dtype = dtype
        self.device = device
        # The registered adapters' tensors by name, each carrying its weights id as `id`
        self.registry: dict[str, LoraAdapter] = {}
        self._ref_ids: dict[str, int] = {}  # name -> the id of its registration's reference
        # DoRA adapters' scales on the device, by weights id (small: two [L, H_out] per module)
        self._dora: dict[int, DoraScales] = {}
        self.runner: HostLoraRunner = HostLora(self.registry)
        self.memory = HostAdapterMemory(config.adapter_host_bytes or default_budget_bytes())
        log.info("adapters may hold %.1f MiB of host memory (--adapter-host-bytes%s)",
                 self.memory.budget_bytes / 2**20,
                 "" if config.adapter_host_bytes else f"; default {DEFAULT_BUDGET_FRACTION:.0%} "
                 "of this machine's memory")  # fmt: skip
        self.repository = self.workers = None
        if use_workers and config.num_cpu_workers:
            self._start_workers(config, max_step_tokens)

    def _start_workers(self, config: LoraConfig, max_step_tokens: int) -> None:
        from toppings.cpu_lora.pool import CpuLoraPool
        from toppings.cpu_lora.repository import HostRepository

        host_dtype = torch.bfloat16 if self.dtype == torch.bfloat16 else torch.float32
        self.repository = HostRepository.create(
            self.model_config, HOST_REPOSITORY_BYTES, dtype=host_dtype
        )
        try:
            self.workers = CpuLoraPool(
                self.repository,
                self.model_config,
                config.num_cpu_workers,
                cores=list(config.cpu_cores) or None,
                max_tokens=max_step_tokens,
                spin_us=config.cpu_spin_us,
            )
        except BaseException:
            self.repository.close()
            self.repository.unlink()
            raise
        self.runner = self.workers
        log.info("%d CPU LoRA workers, %d tokens per core", self.workers.num_workers,
                 self.workers.tokens_per_core)  # fmt: skip

    def check_room(self, name: str, shape: AdapterShape) -> None:
        """507 when an adapter of `shape` would not fit in the workers' arena now."""
        if self.repository is None:
            return
        host_bytes = self.repository.block_bytes_for(shape.rank, shape.targeted)
        if host_bytes > self.repository.free_bytes:
            raise RequestError(
                f"adapter {name!r} needs {host_bytes} bytes in the CPU workers' shared "
                f"arena, which has {self.repository.free_bytes} of its "
                f"{self.repository.capacity_bytes} bytes free",
                507,
                INSUFFICIENT_STORAGE,
            )

    def hold(self, adapter: LoraAdapter, digest: str | None = None) -> tuple[LoraAdapter, int]:
        """Charge a validated adapter to the host budget and put it in the workers' arena;
        returns it as held and the weights id of the registered name it shares its content
        with (0: a new content; content already held under another name is shared, not copied).
        409 when its name is registered; 507 past the budget or the arena (nothing held).
        `digest`: the adapter's content digest when the caller has it (None: computed here)."""
        if adapter.name in self.registry:
            raise RequestError(f"adapter {adapter.name!r} is already loaded", 409, "conflict")
        adapter, digest = self.memory.shared(adapter, digest)
        shares = self.memory.name_of_copy(digest)  # a name holding the same content
        host_bytes = adapter.num_bytes
        if self.repository is not None:
            host_bytes += self.repository.block_bytes(adapter)
        try:
            self.memory.charge(adapter, digest, host_bytes)
        except HostMemoryFull as exc:
            raise RequestError(str(exc), 507, INSUFFICIENT_STORAGE) from None
        try:
            if self.repository is not None:
                self._add_to_repository(adapter, shares)
        except BaseException:
            self.memory.release(adapter.name)
            raise
        if self.device.type == "cuda" and shares is None:
            # Pinned host copies: the loader's copies then run asynchronously on its stream.
            for key, (a, b) in adapter.weights.items():
                adapter.weights[key] = (a.pin_memory(), b.pin_memory())
        return adapter, 0 if shares is None else self.registry[shares].id

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

    def add(self, adapter: LoraAdapter, ref: AdapterRef) -> None:
        """Register a held adapter under its reference (`adapter.id` is `ref.weights_id`):
        requests can find it by name, and a DoRA adapter's scales go to the device once per
        weights."""
        self.registry[adapter.name] = adapter
        self._ref_ids[adapter.name] = ref.id
        if adapter.dora is not None and adapter.id not in self._dora:
            self._dora[adapter.id] = adapter.dora.to(self.device, self.dtype)

    def names_of(self, weights_id: int) -> list[str]:
        """The registered names whose rows are those of `weights_id`."""
        return [n for n, a in list(self.registry.items()) if a.id == weights_id]

    def drop(self, name: str) -> None:
        """Free everything held for the adapter registered as `name` (what it shares with
        another registered name stays for that one)."""
        weights_id = self.registry[name].id
        if self.repository is not None and self.repository.lookup(name) is not None:
            self.repository.remove(name)
        del self.registry[name]
        del self._ref_ids[name]
        if not self.names_of(weights_id):
            self._dora.pop(weights_id, None)
        self.memory.release(name)

    def lookup(self, ref: AdapterRef) -> LoraAdapter | None:
        """The registered adapter of this reference (None once it was unregistered, even if
        another one holds its name now)."""
        adapter = self.registry.get(ref.name)
        return adapter if adapter is not None and self._ref_ids[ref.name] == ref.id else None

    def dora_scales(self, weights_id: int) -> DoraScales | None:
        """The device copy of a DoRA adapter's scales (None: not a registered DoRA adapter)."""
        return self._dora.get(weights_id)

    def worker_stats(self) -> list[dict]:
        return [] if self.workers is None else self.workers.workers_info()

    def close(self) -> None:
        """Stop the workers and unlink the shared arena (idempotent)."""
        if self.workers is not None:
            self.workers.close()
        if self.repository is not None:
            self.repository.close()
            self.repository.unlink()
            self.repository = None
