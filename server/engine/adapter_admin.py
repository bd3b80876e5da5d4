"""Adding and removing adapters while the engine serves: what may wait for a step, what may not.

An adapter's tables live in several places: the adapter manager's host side (host memory, the
CPU workers' arena, the name table, each behind its own lock), its device rows and the cached
KV computed with it (the step's), and the queue policy's record of it (the engine thread's).
A registration or removal takes the engine's step lock only where it touches what a step owns,
so that a cold adapter's registration does not wait for a whole step; what the engine thread
owns of a retired adapter goes there, through its inbox (`retire`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

import torch

from toppings.gpu_lora.host_memory import ContentKey
from toppings.gpu_lora.peft.adapter import LoraAdapter
from toppings.gpu_lora.validate import check_finite_delta
from toppings.server.adapters.manager import AdapterManager
from toppings.server.memory.manager import MemoryManager
from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.sched.queueing import QueuePolicy

log = logging.getLogger(__name__)


class AdapterAdmin:
    """Registrations and removals of adapters beside the running engine; see the module
    docstring."""

    def __init__(
        self,
        lora: AdapterManager,
        memory: MemoryManager,
        queue: QueuePolicy,
        step_lock: threading.Lock,
        dtype: torch.dtype,
        post_retired: Callable[[AdapterRef], None],
    ):
        """step_lock: the engine's, held during a step and while the pool changes. dtype: the
        model's (an adapter's LoRA product must not overflow it). post_retired: hands a retired
        adapter to the engine thread (its inbox), which calls `forget_retired` with it."""
        self._lora, self._memory, self._queue = lora, memory, queue
        self._step_lock = step_lock
        self._dtype = dtype
        self._post_retired = post_retired
        # Registrations and removals change the adapter tables one at a time; a removal takes
        # it after the step lock (`register` says why a registration may not need that).
        self._registering = threading.Lock()

    def open(self, name: str, path: str) -> LoraAdapter:
        """Read and check a PEFT directory without registering it: the slow part of a load
        (the file read, the checks), which needs no lock, so that a caller may run several at
        once and register each when it is read (the resolver does)."""
        adapter = self._lora.open(path, name)
        check_finite_delta(adapter, self._dtype)
        return adapter

    def register(self, adapter: LoraAdapter, content: ContentKey | None = None) -> AdapterRef:
        """Make an adapter from `open` (or one `remove` returned) servable; `content`: its
        content key (gpu_lora.host_memory's `ContentKey` of this very adapter) when the caller
        made it, else it is made here.

        Only a LoRA mode that preloads (cached) puts the adapter on the device here, which a
        step owns: it takes the step lock. Otherwise registering touches the host side alone
        (each part behind its own lock; the step reads the host tables by name, never in the
        middle of this adapter's entry, since no request can name it before the name table has
        it, its last step), so it does not wait for a running step: a cold adapter's
        registration used to wait for a whole step, its device loads included."""
        lock = self._step_lock if self._lora.mode.preload else contextlib.nullcontext()
        with lock, self._registering:
            ref = self._lora.register(adapter, content)
        targets = ",".join(adapter.target_modules)
        log.info("adapter %s (id %d): rank %d, targets %s", adapter.name, ref.id, adapter.rank,
                 targets)  # fmt: skip
        return ref

    def remove(self, name: str) -> LoraAdapter:
        """Unregister an adapter; refused (409) while a request accepted for it has not ended.
        Returns the adapter as it was held (its host tensors, which it no longer charges)."""
        with self._step_lock, self._registering:
            ref = self._lora.refs.retire(name)  # 404, 409; no request acquires it from here
            adapter = self._lora.unregister(ref)
            self._forget(ref)
        log.debug("adapter %s removed", name)  # its caller says why (an unload, an eviction)
        return adapter

    def retire(self, name: str) -> LoraAdapter:
        """`remove` without waiting for a running step, outside the cached mode: the name and
        the host side go now, what the engine thread owns (the adapter's device rows, its
        cached KV, the queue policy's record) before its next plan. The resolver's evictions
        take it: they are on a first use's way to its first token."""
        if self._lora.mode.preload:
            return self.remove(name)  # the device is the step's
        with self._registering:
            ref = self._lora.refs.retire(name)  # 404, 409; no request acquires it from here
            adapter = self._lora.unregister_host(ref)
        self._post_retired(ref)  # the rest: forget_retired, on the engine thread
        log.debug("adapter %s removed (its device rows before the next step)", name)
        return adapter

    def forget_retired(self, ref: AdapterRef) -> None:
        """A retired adapter's device rows and the rest (the engine thread, from its inbox)."""
        with self._step_lock:
            self._lora.forget_rows(ref.weights_id)
            self._forget(ref)

    def _forget(self, ref: AdapterRef) -> None:
        """What the engine keeps of an unregistered adapter, beside its rows."""
        self._memory.forget_adapter(ref)
        self._queue.forget_adapter(ref)
