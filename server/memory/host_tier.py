"""The host tier of the KV cache: blocks swapped out of the device pool instead of dropped.

A fixed number of host blocks, each the same [L, K, bt, D] keys and values as a device block.
Copies go through the host (`.cpu()` / `.to(device)`), so the same code serves a GPU and a
CPU-only machine; there, where the "device" is host memory too, `link_gbps` makes each copy
last as long as it would over a link of that speed (figures measured with it are labelled
"emulated link", as for adapter loads).
"""

from __future__ import annotations

import time

import torch

from toppings.server.memory.kv_cache import KVPool


class HostKV:
    """Host copies of KV blocks; see the module docstring."""

    def __init__(self, kv: KVPool, num_blocks: int, link_gbps: float = 0.0):
        self.kv = kv
        self.num_blocks = num_blocks
        self.link_gbps = link_gbps
        bt = kv.block_tokens
        shape = (kv.k.shape[0], kv.k.shape[1], num_blocks * bt, kv.k.shape[3])
        self.k = torch.empty(shape, dtype=kv.k.dtype)  # [L, K, Hb*bt, D], host memory
        self.v = torch.empty(shape, dtype=kv.v.dtype)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._offsets = torch.arange(bt, dtype=torch.int64)
        self.bytes_out = self.bytes_in = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def seconds_per_block(self) -> float:
        """Time of one block's copy over the link (0: unthrottled)."""
        return self.kv.block_bytes * 8 / (self.link_gbps * 1e9) if self.link_gbps else 0.0

    def swap_out(self, block: int, host_block: int) -> None:
        """Copy device block -> host block (the device block is then free to reuse)."""
        started = time.perf_counter()
        dev, host = self.kv.slots_of([block]), self._host_slots(host_block)
        self.k[:, :, host] = self.kv.k[:, :, dev].cpu()
        self.v[:, :, host] = self.kv.v[:, :, dev].cpu()
        self.bytes_out += self.kv.block_bytes
        self._throttle(started)

    def swap_in(self, host_block: int, block: int) -> None:
        """Copy host block -> device block."""
        started = time.perf_counter()
        dev, host = self.kv.slots_of([block]), self._host_slots(host_block)
        device = self.kv.k.device
        self.kv.k[:, :, dev] = self.k[:, :, host].to(device)
        self.kv.v[:, :, dev] = self.v[:, :, host].to(device)
        self.bytes_in += self.kv.block_bytes
        self._throttle(started)

    def _host_slots(self, host_block: int) -> torch.Tensor:
        return host_block * self.kv.block_tokens + self._offsets

    def _throttle(self, started: float) -> None:
        rest = self.seconds_per_block() - (time.perf_counter() - started)
        if rest > 0 and self.kv.k.device.type == "cpu":
            time.sleep(rest)
