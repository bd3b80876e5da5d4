"""A request whose adapter found no device room, served from the host until room frees.

Under cpu-assisted (`LoraMode.host_workers`) a request never waits for adapter memory: when
admission cannot make room for its adapter on the device (every adapter there is held by a
running request), it is admitted with a `HostServed` reference instead of a device cache entry,
and the host computes its LoRA delta in every layer (the CPU workers, or the in-process
`HostLora`), as it does for the layers of an adapter still loading. This is Toppings' answer to
the slot cliff (SGLang's median TTFT went from 40 ms to 6.3 s with 16 adapters over 8 slots:
sgl-project/sglang PR #13349): the host holds every adapter, so a cold one runs at once.

The scheduler then tries each iteration to move such requests to the device
(`AdapterManager.promote`): where room is there without evicting an adapter in use or wanted, the
reference takes a device cache entry, whose load proceeds layer group by layer group while the
layers not there yet stay on the host. A `HostServed` reads as a `CacheEntry` (`resident`,
`ticket`) to everything that builds a step, before and after, so the persistent decode batch that
keeps it needs no update: a step built afterwards reads the device entry through it.
"""

from __future__ import annotations

from toppings.gpu_lora.adapter_pool import ResidentAdapter
from toppings.gpu_lora.cache import CacheEntry
from toppings.gpu_lora.loader import LoadTicket
from toppings.gpu_lora.peft.adapter import LoraAdapter


class HostServed:
    """One request's reference on an adapter computed on the host (see the module docstring).

    Before `device` is set: `resident` names the adapter (its id keys the host runner's tables;
    its offset is never read, as no layer is ready) and `ticket` has no layer ready and never
    will, so every layer goes to the host. After: the device entry's, which the request holds one
    reference on (given back by `AdapterManager.release`).
    """

    def __init__(self, adapter: LoraAdapter, num_layers: int):
        self.adapter = adapter  # as registered: what a move to the device loads
        self._host = ResidentAdapter(
            adapter.name, 0, adapter.rank, adapter.scale, frozenset(adapter.target_modules),
            adapter.id,
        )  # fmt: skip
        self._ticket = LoadTicket(num_layers)  # never marked: no layer on the device
        self.device: CacheEntry | None = None

    @property
    def resident(self) -> ResidentAdapter:
        return self.device.resident if self.device is not None else self._host

    @property
    def ticket(self) -> LoadTicket:
        return self.device.ticket if self.device is not None else self._ticket
