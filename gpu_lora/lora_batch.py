"""The LoRA side of one engine step: which pool rows each request reads, and the kernel calls.

Built once per step (the offsets are the same in every layer) and called by the model after each
base projection: `add(layer, x, ((module, y), ...))` adds every request's delta into y in place.
Decode on a CPU uses the masked dense plan of `dense_decode`; everything else calls the kernels.
"""

from __future__ import annotations

import torch

from gpu_lora.adapter_pool import AdapterPool, ResidentAdapter
from gpu_lora.dense_decode import DenseDecodePlan


class LoraBatch:
    """Per-module offsets, ranks and scales of the B requests of a step."""

    def __init__(
        self,
        pool: AdapterPool,
        kernels,
        kernel: str,
        adapters: list[ResidentAdapter | None],
        seg_starts: list[int],
        is_prefill: bool,
    ):
        self.pool = pool
        self.is_prefill = is_prefill
        self._dense = None
        if not is_prefill and pool.device.type == "cpu":
            self._dense = DenseDecodePlan(pool, adapters, padded=kernel == "bgmv")
            return
        device = pool.device
        self._seg_starts = torch.tensor(seg_starts, dtype=torch.int32, device=device)
        self._fn = getattr(kernels, f"{kernel}_{'prefill' if is_prefill else 'decode'}")
        self._padded = kernel == "bgmv"
        offsets = torch.tensor([a.offset if a else 0 for a in adapters], dtype=torch.int32)
        scales = torch.tensor([a.scale if a else 0.0 for a in adapters], dtype=torch.float32)
        offsets, scales = offsets.to(device), scales.to(device)
        self._args: dict[str, tuple] = {}
        for module in pool.lora_a:
            ranks = [a.rank if a is not None and module in a.targets else 0 for a in adapters]
            if max(ranks, default=0) == 0:
                continue  # no request of this step adapts this projection
            ranks_t = torch.tensor(ranks, dtype=torch.int32, device=device)
            self._args[module] = (offsets, ranks_t, scales, max(ranks))

    @property
    def modules(self) -> tuple[str, ...]:
        return self._dense.modules if self._dense is not None else tuple(self._args)

    def add(self, layer: int, x: torch.Tensor, outputs) -> None:
        """y += LoRA delta for each (module, y) pair; x [T, H_in], y [T, H_out], in place."""
        if self._dense is not None:
            for module, y in outputs:
                self._dense.add(module, layer, x, y)
            return
        for module, y in outputs:
            args = self._args.get(module)
            if args is None:
                continue
            offsets, ranks, scales, max_rank = args
            a = self.pool.lora_a[module][layer]  # [C, H_in]
            b = self.pool.lora_b[module][layer]  # [C, H_out]
            lead = (self._seg_starts,) if self.is_prefill else ()
            tail = (max_rank,) if self._padded else ()
            self._fn(y, x, a, b, *lead, offsets, ranks, scales, *tail)
