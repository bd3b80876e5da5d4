"""Everything the engine holds for adapters: the registry, the device cache, the host side.

Registered adapters live in host memory (their `LoraAdapter` tensors and, with CPU workers, the
shared-memory `HostRepository` the workers read). The device side is the adapter pool, filled by
the pipelined loader and governed by the byte-budget cache. Layers not yet on the device are
computed by `host`: the CPU worker pool, or in-process when the server runs no workers.
"""

from __future__ import annotations

import logging

import torch

from toppings.gpu_lora.adapter_pool import AdapterPool
from toppings.gpu_lora.cache import AdapterCache
from toppings.gpu_lora.eviction import make_policy
from toppings.gpu_lora.host_lora import HostLora
from toppings.gpu_lora.loader import PipelinedLoader
from toppings.gpu_lora.peft_format import LoraAdapter
from toppings.server.config import EngineConfig
from toppings.server.model_config import ModelConfig
from toppings.server.request import RequestError

log = logging.getLogger(__name__)

HOST_REPOSITORY_BYTES = 4 << 30  # shared arena for the workers (sparse: only used pages count)


class AdapterManager:
    """Registry, device cache and host compute of one engine's adapters."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype):
        self.config = config
        self.model_config = model_config
        self.registry: dict[str, LoraAdapter] = {}
        self.pool = AdapterPool(model_config, dtype, config.device)
        self.loader = PipelinedLoader(self.pool, config.layers_per_group, config.link_gbps)
        self.cache = AdapterCache(
            self.pool, self.loader, make_policy(config.eviction), config.adapter_cache_bytes or None
        )
        self.host = HostLora(self.registry)
        self.repository = self.workers = None
        if config.lora_mode == "cpu-assisted" and config.num_cpu_workers:
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
                max_tokens=max(self.config.max_prefill_tokens, self.config.max_batch_size),
                spin_us=self.config.cpu_spin_us,
            )
        except BaseException:
            self.repository.close()
            self.repository.unlink()
            raise
        self.host = self.workers
        log.info("%d CPU LoRA workers, %d tokens per core", self.workers.num_workers,
                 self.workers.tokens_per_core)  # fmt: skip

    def register(self, adapter: LoraAdapter) -> None:
        """Make a validated adapter servable (called with the engine's lock held)."""
        if adapter.name in self.registry:
            raise RequestError(f"adapter {adapter.name!r} is already loaded", 409, "conflict")
        if self.repository is not None:
            self.repository.add(adapter)
        if self.pool.device.type == "cuda":
            # Pinned host copies: the loader's copies then run asynchronously on its stream.
            for key, (a, b) in adapter.weights.items():
                adapter.weights[key] = (a.pin_memory(), b.pin_memory())
        self.registry[adapter.name] = adapter
        if self.config.lora_mode == "cached":
            # The ideal upper bound: every adapter on the device before any request, pinned.
            entry = self.cache.acquire(adapter)
            if entry is None:
                self.unregister(adapter.name)
                raise RequestError("the adapter cache is full", 507, "insufficient_storage")
            entry.ticket.wait()

    def unregister(self, name: str) -> None:
        if self.config.lora_mode == "cached" and name in self.cache.entries:
            self.cache.release(name)  # the registration pin
        self.cache.forget(name)
        if self.repository is not None and self.repository.lookup(name) is not None:
            self.repository.remove(name)
        del self.registry[name]

    def is_resident(self, name: str) -> bool:
        entry = self.cache.entries.get(name)
        return entry is not None and entry.ticket.done

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
