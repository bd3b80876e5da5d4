"""The host side of cpu-assisted LoRA: one typed call, two implementations.

`HostLoraRunner` is what the engine's LoRA step calls for the layers still loading. `HostLora`
computes it in the engine's own process from the host copies of the adapters (a server with
`--cpu-workers 0`); `cpu_lora.pool.CpuLoraPool` computes it in pinned worker processes over shared
memory (and, when a worker dies mid-call, recomputes that job itself with `cpu_lora.compute`).
Both compute each segment with the same kernel, `gpu_lora.kernels.cpu.lora_rows`. Segments name
their adapter by id (`LoraAdapter.id`, the key of its rows in the device pool), never by name: a
name may be unloaded and loaded again with other weights while a step runs.
"""

from __future__ import annotations

from typing import Protocol

import torch

from toppings.gpu_lora.kernels.cpu import lora_rows
from toppings.gpu_lora.peft_format import LoraAdapter


class HostLoraRunner(Protocol):
    """Computes the LoRA deltas of requests whose adapter layer is not on the device yet."""

    def run(
        self,
        layer: int,
        x: torch.Tensor,
        segments: list[tuple[int, int, int]],
        modules: tuple[str, ...],
        *,
        copy: bool = True,
    ) -> dict[str, torch.Tensor]:
        """Deltas of `modules` at `layer` for token segments (adapter id, start, end) of
        x [T, H_in]: module -> float32 [T, H_out], zero outside every segment. copy=False lets
        the result be a view that is valid until the next call."""
        ...


class HostLora:
    """`run(layer, x, segments, modules)` over an id -> LoraAdapter table (read live)."""

    def __init__(self, adapters: dict[int, LoraAdapter]):
        self.adapters = adapters

    def run(
        self,
        layer: int,
        x: torch.Tensor,
        segments: list[tuple[int, int, int]],
        modules: tuple[str, ...],
        *,
        copy: bool = True,
    ) -> dict[str, torch.Tensor]:
        """Deltas of `modules` at `layer` for segments (adapter id, start, end) of x [T, H_in].

        Returns module -> float32 [T, H_out]; rows outside every segment are zero. Arithmetic is
        in float32 whatever the adapters are held at: torch's bfloat16 matmul on a CPU has a
        fixed cost a call that a decode's few tokens never repay (docs/benchmarks.md,
        "Measurements behind the code"). `copy` is accepted for the worker pool's signature;
        these tensors are always fresh.
        """
        out: dict[str, torch.Tensor] = {}
        xf = x.detach().to("cpu", torch.float32)
        for module in modules:
            y = None
            for adapter_id, start, end in segments:
                adapter = self.adapters[adapter_id]
                weights = adapter.weights.get((layer, module))
                if weights is None:
                    continue
                a, b = weights  # A [r, H_in], B [H_out, r]
                if y is None:
                    y = torch.zeros(x.shape[0], b.shape[0])
                lora_rows(y[start:end], xf[start:end], a.float(), b.float().T, adapter.scale)
            if y is not None:
                out[module] = y
        return out
