"""What a registered adapter holds outside the device cache, by id.

Registered adapters live in host memory: their `LoraAdapter` tensors, one copy per content
charged to a host budget (gpu_lora/host_memory.py), and with CPU workers a block in the shared
`HostRepository` arena the workers read. Layers not yet on the device are computed by `runner`:
the CPU worker pool, or in-process (`HostLora` over the held copies) when the server runs no
workers. A DoRA adapter's scales are copied to the device once, at registration. Names
registered with the same weights share all of it (tensors, arena block, DoRA scales) under one
id, the weights id the device cache holds their rows under (`AdapterRef.weights_id`): the host
copies, the arena and the runner key on that id, and each registration is known by its
`AdapterRef.id`. Nothing here looks an adapter up by name: the API resolved the name once
(registry.py), and a name unloaded and loaded again with other weights is another id all the
way down. Registering is `shared` (which held copy, if any, an adapter's content is) then `add`
once the adapter has its reference; `drop` frees everything held for a registration, and what
it shared with no other one left. The reference, the device charge and the load are manager.py's.
"""

from __future__ import annotations

import logging

import torch

from toppings.gpu_lora.dora import DoraScales
from toppings.gpu_lora.host_lora import HostLora, HostLoraRunner
from toppings.gpu_lora.host_memory import (
    DEFAULT_BUDGET_FRACTION,
    ContentKey,
    HostAdapterMemory,
    HostMemoryFull,
    default_budget_bytes,
)
from toppings.gpu_lora.peft.adapter import AdapterShape, LoraAdapter
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
        # What registered adapters are held at (`load_peft_adapter`'s dtype), here and in the
        # workers' arena: a bfloat16 model's every copy of them is bfloat16 (float32 otherwise).
        self.weights_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        # Each registration's adapter by `AdapterRef.id` (its `id` is the weights id), in
        # registration order; and each held copy by weights id (what the runner computes with).
        self._registered: dict[int, LoraAdapter] = {}
        self.version = 0  # moves with every registration and every drop (/stats adapters_since)
        self._copies: dict[int, LoraAdapter] = {}
        # DoRA adapters' scales on the device, by weights id (small: two [L, H_out] per module)
        self._dora: dict[int, DoraScales] = {}
        self._in_process = HostLora(self._copies)  # the runner unless workers start
        self.runner: HostLoraRunner = self._in_process
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

        self.repository = HostRepository.create(
            self.model_config, HOST_REPOSITORY_BYTES, dtype=self.weights_dtype
        )
        try:
            self.workers = CpuLoraPool(
                self.repository,
                self.model_config,
                config.num_cpu_workers,
                cores=list(config.cpu_cores) or None,
                max_tokens=max_step_tokens,
                spin_us=config.cpu_spin_us,
                timeout_s=config.cpu_worker_timeout,
            )
        except BaseException:
            self.repository.close()
            self.repository.unlink()
            raise
        self.runner = self.workers
        log.info("%d CPU LoRA workers, %d tokens per core", self.workers.num_workers,
                 self.workers.tokens_per_core)  # fmt: skip

    def check_room(self, name: str, shape: AdapterShape) -> None:
        """507 when an adapter of `shape` would not fit in the workers' arena now (`name`: for
        the message)."""
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

    def shared(
        self, adapter: LoraAdapter, content: ContentKey | None = None
    ) -> tuple[LoraAdapter, ContentKey, int]:
        """A validated adapter as it will be held, its content key, and the weights id of the
        copy of that content already held (0: a new content; then the returned adapter's
        tensors are its own, else the copy's). `content`: the adapter's content key when the
        caller has it (None: made here)."""
        adapter, content = self.memory.shared(adapter, content)
        return adapter, content, self.memory.held_id(content) or 0

    def add(self, adapter: LoraAdapter, content: ContentKey, ref: AdapterRef) -> None:
        """Hold `adapter` (from `shared`, its `id` set to `ref.weights_id`) for registration
        `ref`: a new content is charged to the host budget and put in the workers' arena, a
        held one is shared. 507 past the budget or the arena (nothing held)."""
        if ref.id in self._registered:
            raise ValueError(f"registration {ref.id} of {ref.name!r} is already held")
        host_bytes = adapter.num_bytes  # what a new copy is charged (a held one: nothing)
        if self.repository is not None:
            host_bytes += self.repository.block_bytes(adapter)
        try:
            is_new = self.memory.charge(ref.id, adapter, content, host_bytes)
        except HostMemoryFull as exc:
            raise RequestError(str(exc), 507, INSUFFICIENT_STORAGE) from None
        if is_new:
            try:
                self._add_copy(adapter)
            except BaseException:
                self.memory.release(ref.id)
                raise
        self._registered[ref.id] = adapter
        self.version += 1
        if adapter.dora is not None and adapter.id not in self._dora:
            self._dora[adapter.id] = adapter.dora.to(self.device, self.dtype)

    def _add_copy(self, adapter: LoraAdapter) -> None:
        """Hold a new content under its weights id: in the workers' shared arena (no room
        there is a 507: the server keeps serving the adapters it has), pinned on CUDA, and in
        the table the in-process runner reads."""
        from toppings.cpu_lora.repository import RepositoryFullError
        from toppings.cpu_lora.shm import SharedMemoryFull

        if self.repository is not None:
            try:
                self.repository.add(adapter)
            except (SharedMemoryFull, RepositoryFullError) as exc:
                raise RequestError(
                    f"cannot load adapter {adapter.name!r}: {exc}", 507, INSUFFICIENT_STORAGE
                ) from None
        if self.device.type == "cuda":
            # Pinned host copies: the loader's copies then run asynchronously on its stream.
            for key, (a, b) in adapter.weights.items():
                adapter.weights[key] = (a.pin_memory(), b.pin_memory())
        self._copies[adapter.id] = adapter

    @property
    def num_registered(self) -> int:
        return len(self._registered)

    def registered(self) -> list[LoraAdapter]:
        """Every registration's adapter, in registration order (a copy: any thread)."""
        return list(self._registered.values())

    def drop(self, ref: AdapterRef) -> None:
        """Free everything held for registration `ref` (what it shares with another
        registration stays for that one)."""
        weights_id = self._registered.pop(ref.id).id
        self.version += 1
        if self.memory.release(ref.id):  # the last registration of its content
            self._copies.pop(weights_id, None)
            self._in_process.forget(weights_id)
            self._dora.pop(weights_id, None)
            if self.repository is not None and self.repository.lookup(weights_id) is not None:
                self.repository.remove(weights_id)

    def lookup(self, ref: AdapterRef) -> LoraAdapter | None:
        """The adapter of registration `ref` (None once it was unregistered, even if another
        one holds its name now)."""
        return self._registered.get(ref.id)

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
