"""A per-layer trace of where a request's time goes: adapter copies, host LoRA calls, forward.

`TraceRecorder` is an optional sink handed at construction to the pipelined loader (one
`CopyEvent` per layer-group copy, on the loader thread), to each step's `LoraBatch` (one
`HostLoraEvent` per host call, one `LayerMark` per LoRA point of a layer, on the engine thread)
and to the model runner (one `StepEvent` per forward pass). Every holder keeps None when tracing
is off and tests it before reading the clock, so the hot path does no work for it then.

A recorder rather than `torch.profiler` ranges: the profiler records every aten op of the
forward (its overhead would be part of the very times traced), `record_function` costs a call
into the dispatcher per range even when no profiler runs, and the events wanted here (which
layer group was resident when, which layer went to the host) are ours, not torch's.

Adapters are named by id (`LoraAdapter.id`, the key of their rows), as the layers that record
them know them: a reload under the same name is another adapter here too.

Times are `time.perf_counter()` seconds. Appends to a list are atomic under the GIL, so the
loader thread and the engine thread write without a lock; read the events once the traced
request has ended.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CopyEvent:
    """Layers [first_layer, end_layer) of adapter `adapter_id` copied into their pool rows: the
    loader started at `start_s`, the copies returned at `copied_s`, the group was marked resident at
    `ready_s` (after the emulated link's delay; on CUDA both are enqueue times of the side
    stream's asynchronous copies)."""

    adapter_id: int
    first_layer: int
    end_layer: int
    num_bytes: int
    start_s: float
    copied_s: float
    ready_s: float


@dataclass(frozen=True)
class HostLoraEvent:
    """One host LoRA call at `layer` for `modules` (one input) of adapters `adapter_ids`, as the
    engine saw it: from the submit to the CPU workers (or the in-process computation) until the
    deltas were back."""

    layer: int
    modules: tuple[str, ...]
    adapter_ids: tuple[int, ...]
    start_s: float
    end_s: float


@dataclass(frozen=True)
class LayerMark:
    """The forward reached a LoRA point of `layer` at `at_s` (after that projection's base
    matmul). The last mark of a layer is its down projection's: the layer's end."""

    layer: int
    at_s: float


@dataclass(frozen=True)
class StepEvent:
    """One forward pass of `num_tokens` tokens (a prefill, mixed step or decode step)."""

    is_prefill: bool
    num_tokens: int
    start_s: float
    end_s: float


@dataclass
class TraceRecorder:
    """Collects the events of one engine; see the module docstring."""

    copies: list[CopyEvent] = field(default_factory=list)
    host_calls: list[HostLoraEvent] = field(default_factory=list)
    marks: list[LayerMark] = field(default_factory=list)
    steps: list[StepEvent] = field(default_factory=list)

    def copy_group(self, event: CopyEvent) -> None:
        self.copies.append(event)

    def host_lora(self, event: HostLoraEvent) -> None:
        self.host_calls.append(event)

    def layer_mark(self, layer: int) -> None:
        self.marks.append(LayerMark(layer, time.perf_counter()))

    def step(self, event: StepEvent) -> None:
        self.steps.append(event)

    def clear(self) -> None:
        """Forget every event (e.g. those of a warm-up before the traced request)."""
        self.copies.clear()
        self.host_calls.clear()
        self.marks.clear()
        self.steps.clear()
