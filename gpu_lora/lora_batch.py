"""The LoRA side of one engine step: where each request's delta is computed, layer by layer.

Built once per step (pool offsets are the same in every layer) and called by the model after each
base projection: `add(layer, x, ((module, y), ...))` adds every request's delta into y in place.
The engine orders a step's requests by adapter, so consecutive requests of one adapter form one
run of tokens: prefill runs one matmul pair per run, not per request, and on a CPU decode does
the same (the segment kernel over runs: each adapter's rows read once, no gather, no masked
product over other adapters' ranks). On a GPU decode calls the per-token kernel. A run whose
adapter is still loading (Toppings' CPU-assisted mode) reads its ticket at every layer: layers
already resident run with the others, the rest go to the host (`cpu_lora` workers, or the
in-process `HostLora`) in one call per layer and input, covering every projection that shares
that input. Which kernels run is decided once per engine (`kernels.select`), never per step.
A DoRA adapter's rows are then scaled per output channel (gpu_lora/dora.py), once the delta is
in y wherever it was computed: one multiply (and add, with a bias) per run of its requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from toppings.gpu_lora.adapter_pool import AdapterPool, ResidentAdapter
from toppings.gpu_lora.dora import DoraScales, apply_dora
from toppings.gpu_lora.host_lora import HostLoraRunner
from toppings.gpu_lora.host_runs import HostTable
from toppings.gpu_lora.kernels import LoraBackend
from toppings.gpu_lora.kernels.native import RunsLayout, RunsStep
from toppings.gpu_lora.loader import LoadTicket
from toppings.gpu_lora.targets import LORA_TARGETS
from toppings.gpu_lora.trace import HostLoraEvent, TraceRecorder


@dataclass
class HostLoraStats:
    """Host LoRA calls of an engine and the wall time they took (for /metrics)."""

    calls: int = 0
    seconds: float = 0.0


class LoraBatch:
    """Per-module offsets, ranks and scales of the units of a step (runs or tokens), and tickets.

    A unit is a run of consecutive requests of one adapter (prefill, and decode with
    segment_decode), or one request (per-token decode kernels). dora: each request's DoRA
    scales on the device (None: not a DoRA adapter). trace: gets a LayerMark at each `add` and
    a HostLoraEvent per host call (None: no tracing). version: see `self.version`.
    """

    def __init__(
        self,
        pool: AdapterPool,
        kernels: LoraBackend,
        adapters: list[ResidentAdapter | None],
        seg_starts: list[int],
        is_prefill: bool,
        tickets: list[LoadTicket | None] | None = None,
        dora: list[DoraScales | None] | None = None,
        host: HostLoraRunner | None = None,
        host_stats: HostLoraStats | None = None,
        trace: TraceRecorder | None = None,
        version: int | None = None,
    ):
        self.pool = pool
        # An id of this batch where it may serve several steps (its builder's; None: one step):
        # a caller keeping something made from it (the native decode path's structs) keys it so.
        self.version = version
        self.host_stats = host_stats if host_stats is not None else HostLoraStats()
        self._host = host
        self._trace = trace
        tickets = tickets or [None] * len(adapters)
        self._dora_runs = _dora_runs(dora, seg_starts) if dora and any(dora) else []
        self._segmented = is_prefill or kernels.segment_decode is not None
        if self._segmented:
            first, starts = _runs(adapters, seg_starts)
            adapters = [adapters[i] for i in first]
            tickets = [tickets[i] for i in first]
        else:
            starts = seg_starts
        self._adapters, self._starts = adapters, starts
        self._loading = [(i, t) for i, t in enumerate(tickets) if t is not None and not t.done]
        device = pool.device
        self._seg_starts = torch.tensor(starts, dtype=torch.int32, device=device)
        self._fn = kernels.prefill if is_prefill else kernels.segment_decode or kernels.decode
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
        # What the host computes for the units still loading: every module they target, the
        # ones the pool has no tensors for yet too (an adapter served on the host with no rows
        # on the device: server/adapters/host_served.py)
        self._host_modules = frozenset(
            m for i, _ in self._loading if adapters[i] is not None for m in adapters[i].targets
        )
        self._step = None
        self._layout: RunsLayout | None = None  # native_runs', made once
        if self._segmented and kernels.runs_step is not None:
            tables = {m: (pool.lora_a[m], pool.lora_b[m], a[1]) for m, a in self._args.items()}
            self._step = kernels.runs_step(tables, self._seg_starts, offsets, scales)

    def native_runs(self) -> RunsLayout | None:
        """The step's runs for a native caller that adds every layer's deltas itself (the CPU
        decode path), where nothing of the step's LoRA needs Python: no DoRA, no trace, the
        native runs kernel, and the units still loading (or served on the host) computed in
        every layer from their host copies by the native kernel in this process (the layout's
        `host`; their ranks 0 in the pool's tables); else None (then `add`, layer by layer).
        A unit whose load lands during the step stays on the host for it: the same values."""
        native = isinstance(self._step, RunsStep)
        if not native or self._dora_runs or self._trace is not None:
            return None
        if self._layout is None:  # the same for every call (a batch may serve several steps)
            layout = self._step.layout(tuple(i for i, _ in self._loading))
            if layout is not None and self._loading:
                host = self._host_table(layout.num_layers, layout.dtype)
                layout = None if host is None else replace(layout, host=host)
            self._layout = layout
        return self._layout

    def _host_table(self, num_layers: int, dtype: torch.dtype) -> HostTable | None:
        """The loading units' projections of every layer for the native caller (None: the host
        runner does not make them)."""
        if self._host is None:
            return None
        starts = self._starts
        segments = [(self._adapters[i].id, starts[i], starts[i + 1]) for i, _ in self._loading]
        return self._host.native_table(segments, LORA_TARGETS, num_layers, dtype)

    def add(self, layer: int, x: torch.Tensor, outputs) -> None:
        """y += LoRA delta for each (module, y) pair; x [T, H_in], y [T, H_out], in place."""
        if self._trace is not None:
            self._trace.layer_mark(layer)
        adapted = [(m, y) for m, y in outputs if m in self._args or m in self._host_modules]
        if not adapted:
            return  # no request of this step adapts these projections
        outputs = [(module, y) for module, y in adapted if module in self._args]
        not_ready = [i for i, t in self._loading if t.layers_ready() <= layer]
        if outputs and self._step is not None:  # (none: only units on the host adapt them)
            self._step(layer, x, outputs, not_ready)
        elif outputs:
            for module, y in outputs:
                offsets, ranks, scales, max_rank = self._args[module]
                if not_ready:
                    ranks = ranks.clone()
                    ranks[not_ready] = 0  # these units' rows of this layer are not there yet
                a = self.pool.lora_a[module][layer]  # [C, H_in]
                b = self.pool.lora_b[module][layer]  # [C, H_out]
                lead = (self._seg_starts,) if self._segmented else ()
                # max_rank: BGMV's padding; for MBGMV only a bound that spares a device sync.
                self._fn(y, x, a, b, *lead, offsets, ranks, scales, max_rank)
        if not_ready:
            self._add_on_host(layer, x, adapted, not_ready)
        for start, end, scales in self._dora_runs:
            for module, y in adapted:
                pair = scales.modules.get(module)
                if pair is not None:
                    g, offset = pair
                    apply_dora(y[start:end], g[layer], None if offset is None else offset[layer])

    def _add_on_host(self, layer: int, x: torch.Tensor, outputs, not_ready: list[int]) -> None:
        """One host call for every projection of this input, for the units still loading."""
        starts = self._starts
        segments = [(self._adapters[i].id, starts[i], starts[i + 1]) for i in not_ready]
        begin = time.perf_counter()
        self._host.add(layer, x.detach(), segments, outputs)
        end = time.perf_counter()
        self.host_stats.seconds += end - begin
        self.host_stats.calls += 1
        if self._trace is not None:
            ids = tuple(adapter_id for adapter_id, _, _ in segments)
            modules = tuple(m for m, _ in outputs)
            self._trace.host_lora(HostLoraEvent(layer, modules, ids, begin, end))


def _dora_runs(
    dora: list[DoraScales | None], seg_starts: list[int]
) -> list[tuple[int, int, DoraScales]]:
    """Maximal runs of consecutive requests with the same DoRA scales: (first token, end
    token, scales) each."""
    runs: list[tuple[int, int, DoraScales]] = []
    for i, scales in enumerate(dora):
        if scales is None:
            continue
        if runs and runs[-1][2] is scales and runs[-1][1] == seg_starts[i]:
            runs[-1] = (runs[-1][0], seg_starts[i + 1], scales)
        else:
            runs.append((seg_starts[i], seg_starts[i + 1], scales))
    return runs


def _runs(
    adapters: list[ResidentAdapter | None], seg_starts: list[int]
) -> tuple[list[int], list[int]]:
    """Maximal runs of consecutive requests with the same adapter: (first request of each run,
    run token boundaries [runs + 1])."""
    first, starts = [], []
    for i, adapter in enumerate(adapters):
        if not first or adapter != adapters[first[-1]]:
            first.append(i)
            starts.append(seg_starts[i])
    return first, starts + [seg_starts[-1]]
