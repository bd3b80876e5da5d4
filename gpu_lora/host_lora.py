"""LoRA deltas computed in the engine's own process from the host copies of the adapters.

The same call as `cpu_lora.pool.CpuLoraPool.run`, without worker processes: used when the server
runs no CPU workers, and as the fallback when a worker dies mid-call.
"""

from __future__ import annotations

import torch

from toppings.gpu_lora.peft_format import LoraAdapter


class HostLora:
    """`run(layer, x, segments, modules)` over a name -> LoraAdapter table (read live)."""

    def __init__(self, adapters: dict[str, LoraAdapter]):
        self.adapters = adapters

    def run(
        self,
        layer: int,
        x: torch.Tensor,
        segments: list[tuple[str, int, int]],
        modules: tuple[str, ...],
        *,
        copy: bool = True,
    ) -> dict[str, torch.Tensor]:
        """Deltas of `modules` at `layer` for token segments (adapter, start, end) of x [T, H_in].

        Returns module -> float32 [T, H_out]; rows outside every segment are zero. `copy` is
        accepted for the worker pool's signature; these tensors are always fresh.
        """
        out: dict[str, torch.Tensor] = {}
        xf = x.detach().to("cpu", torch.float32)
        for module in modules:
            y = None
            for name, start, end in segments:
                adapter = self.adapters[name]
                weights = adapter.weights.get((layer, module))
                if weights is None:
                    continue
                a, b = weights  # A [r, H_in], B [H_out, r]
                if y is None:
                    y = torch.zeros(x.shape[0], b.shape[0])
                y[start:end] = (xf[start:end] @ a.T) @ b.T * adapter.scale
            if y is not None:
                out[module] = y
        return out
