"""The native call of the host LoRA of a step's segments, made once and called every layer.

`HostLora.add` (gpu_lora/host_lora.py) computes the segments served from the host with the
pool's kernel, `lora_runs` (gpu_lora/kernels/native.py), over the adapters' host tensors where
they lie: each (segment, module) is a projection of its own, whose A and B^T are that adapter's
tensors of the layer and whose ranks are the segment's rank in its run and 0 in every other run.
What stays the same over a step's layers (the runs, their scales, the ranks) is made once here,
each layer's structs the first time it is called (a decode step's plan serves the steps after it
while its requests stay), and a call writes only the outputs' pointers (as `RunsStep` does for
the pool's rows): bench_cpu_decode_paths has a host-served decode step against the same step
from the pool. `table` gives every layer's structs at once to a native caller that adds each
layer's deltas itself (the CPU decode step in one call, server/model/decode_path.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from toppings.gpu_lora.kernels import native
from toppings.gpu_lora.peft.adapter import LoraAdapter


@dataclass(frozen=True)
class HostTable:
    """Host runs for a native caller (native_api.h's `LoraHost`): `procs` [layers, modules,
    per_slot] LoraProj (A 0 where a segment does not adapt the module; y and ld_y left to the
    caller), the addresses of the runs' starts, offsets and scales, their number, and each
    adapted module's (H_in, H_out). It holds what its addresses point into (`holds`: the runs'
    tensors and the adapters), so it stays valid while it lives."""

    procs: ctypes.Array
    per_slot: int
    starts: int
    offsets: int
    scales: int
    num_runs: int
    shapes: dict[str, tuple[int, int]]
    holds: tuple


class HostRuns:
    """`lora_runs` over segments (adapter, start, end) of a step, for a tuple of modules.

    The adapters are held at the input's dtype with B over a contiguous B^T (`HostLora` checks);
    their tensors stay alive as long as this object (it holds the adapters).
    """

    def __init__(
        self, segments: Sequence[tuple[LoraAdapter, int, int]], modules: tuple[str, ...]
    ) -> None:
        """segments: non-overlapping token ranges, any order; modules: the projections of the
        calls (the outputs' modules, in order)."""
        ordered = sorted(segments, key=lambda s: s[1])
        starts: list[int] = []
        scales: list[float] = []
        runs: list[int] = []  # each segment's run
        for adapter, start, end in ordered:
            if not starts or starts[-1] < start:  # the first, or a gap: a run nothing adapts
                if starts:
                    scales.append(0.0)
                starts.append(start)
            runs.append(len(scales))
            scales.append(adapter.scale)
            starts.append(end)
        self.modules = modules
        self._starts = torch.tensor(starts, dtype=torch.int32)
        self._offsets = torch.zeros(len(scales), dtype=torch.int32)
        self._scales = torch.tensor(scales, dtype=torch.float32)
        # one projection per (segment, module): its adapter and module's index in `modules`
        self._entries = [(adapter, i) for adapter, _, _ in ordered for i in range(len(modules))]
        ranks = torch.zeros(len(self._entries) + 1, len(scales), dtype=torch.int32)
        for k, run in enumerate(runs):
            ranks[k * len(modules) : (k + 1) * len(modules), run] = ordered[k][0].rank
        self._ranks = ranks  # [P + 1, runs]; the last row all 0: a module not adapted here
        row = ranks.stride(0) * ranks.element_size()
        self._rank_rows = [ranks.data_ptr() + p * row for p in range(len(self._entries) + 1)]
        self._module_of = [i for _, i in self._entries]
        self._layers: dict[int, ctypes.Array] = {}  # layer -> its structs (see `_layer`)
        self._widths: tuple[int, ...] = ()  # (H_in, each module's H_out) they were made for
        self._table: HostTable | None = None  # `table`'s, made once
        self.tokens = starts[-1]

    def __call__(
        self, layer: int, x: torch.Tensor, outputs: Sequence[tuple[str, torch.Tensor]]
    ) -> bool:
        """y += each segment's delta of `layer` for every (module, y), in place; x [T, H_in],
        y [T, H_out] of the adapters' dtype on the CPU, rows contiguous. False, having done
        nothing, when x or an output does not fit (the caller takes the general path)."""
        if x.dim() != 2 or x.stride(1) != 1 or x.shape[0] < self.tokens:
            return False
        for _, y in outputs:
            if y.dim() != 2 or y.dtype != x.dtype or y.stride(1) != 1 or y.shape[0] != x.shape[0]:
                return False
        widths = (x.shape[1], *(y.shape[1] for _, y in outputs))
        procs = self._layers.get(layer) if widths == self._widths else None
        if procs is None and (procs := self._layer(layer, widths)) is None:
            return False
        pointers = [(y.data_ptr(), y.stride(0)) for _, y in outputs]
        for p, i in zip(procs, self._module_of):
            p.y, p.ld_y = pointers[i]
        native.call_runs(x, procs, self._starts, self._offsets, self._scales)
        return True

    def _layer(self, layer: int, widths: tuple[int, ...]) -> ctypes.Array | None:
        """The structs of `layer`, made once: each projection's tables, its rank row and width
        (a module its adapter leaves alone here: the zero row, no tables); None, keeping
        nothing, where a table does not fit `widths` (H_in, each module's H_out)."""
        if widths != self._widths:
            self._layers.clear()
        procs = (native.LoraProj * len(self._entries))()
        zero = self._rank_rows[-1]
        for p, rank_row, (adapter, i) in zip(procs, self._rank_rows, self._entries):
            p.pool_rows, p.H_out, p.ranks = adapter.rank, widths[1 + i], zero
            weights = adapter.weights.get((layer, self.modules[i]))
            if weights is None:
                continue  # rank 0 in every run: the kernel reads no table of it
            a, b = weights  # A [r, H_in], B [H_out, r] over a contiguous B^T
            if a.shape[1] != widths[0] or b.shape[0] != widths[1 + i]:
                return None
            p.A, p.Bt, p.ranks = a.data_ptr(), b.data_ptr(), rank_row
        self._widths = widths
        self._layers[layer] = procs
        return procs

    def table(self, num_layers: int) -> HostTable | None:
        """Every layer's projections at once (see HostTable), `modules` in order; None where
        two adapters disagree on a module's shape. Made once."""
        if self._table is not None:
            return self._table
        width, per_slot = len(self.modules), len(self._entries) // len(self.modules)
        procs = (native.LoraProj * (num_layers * width * per_slot))()
        shapes: dict[str, tuple[int, int]] = {}
        for p, (adapter, i) in enumerate(self._entries):  # segment p // width, module i
            module, rank_row = self.modules[i], self._rank_rows[p]
            for layer in range(num_layers):
                weights = adapter.weights.get((layer, module))
                if weights is None:
                    continue  # A 0: the caller leaves it out
                a, b = weights  # A [r, H_in], B [H_out, r] over a contiguous B^T
                if shapes.setdefault(module, (a.shape[1], b.shape[0])) != (a.shape[1], b.shape[0]):
                    return None
                proc = procs[(layer * width + i) * per_slot + p // width]
                proc.A, proc.Bt, proc.ranks = a.data_ptr(), b.data_ptr(), rank_row
                proc.pool_rows, proc.H_out = adapter.rank, b.shape[0]
        tensors = (self._starts, self._offsets, self._scales, self._ranks)
        adapters = tuple(adapter for adapter, _ in self._entries)
        self._table = HostTable(procs, per_slot, self._starts.data_ptr(),
                                self._offsets.data_ptr(), self._scales.data_ptr(),
                                self._scales.shape[0], shapes, (*tensors, *adapters))  # fmt: skip
        return self._table
