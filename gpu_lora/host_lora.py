"""The host side of cpu-assisted LoRA: one typed call, two implementations.

`HostLoraRunner` is what the engine's LoRA step calls for the layers still loading. `HostLora`
computes it in the engine's own process from the host copies of the adapters (a server with
`--cpu-workers 0`); `cpu_lora.pool.CpuLoraPool` computes it in pinned worker processes over shared
memory (and, when a worker dies mid-call, recomputes that job itself with `cpu_lora.compute`).
Both compute `run` with the same kernel, `gpu_lora.kernels.cpu.lora_rows`. Segments name
their adapter by id (`LoraAdapter.id`, the key of its rows in the device pool), never by name: a
name may be unloaded and loaded again with other weights while a step runs.

`add` puts the deltas into the projections' outputs. On a CPU engine `HostLora.add` runs every
segment of every projection of the call in one call of the native runs kernel
(`gpu_lora.kernels.native`), reading each adapter's host tensors where they lie (a loaded B is
the transpose of a contiguous B^T, the pool's layout) and adding into y as the pool's rows do,
with the same arithmetic: a request served from the host costs about what one served from the
pool does (its structs' pointers are set in Python each call), not a few small matmuls per
segment, projection and layer (120 a token at 30 layers and four projections).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

import torch

from toppings.gpu_lora.host_runs import HostRuns, HostTable
from toppings.gpu_lora.kernels import native
from toppings.gpu_lora.kernels.cpu import lora_rows
from toppings.gpu_lora.peft.adapter import LoraAdapter

MAX_PLANS = 8  # HostLora's native calls kept (two a step: q/k/v's input and o's)


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

    def add(
        self,
        layer: int,
        x: torch.Tensor,
        segments: list[tuple[int, int, int]],
        outputs: Sequence[tuple[str, torch.Tensor]],
    ) -> None:
        """y += the delta `run` gives of each (module, y) in outputs, y [T, H_out], in place."""
        ...

    def native_table(
        self, segments: list[tuple[int, int, int]], modules: tuple[str, ...], num_layers: int,
        dtype: torch.dtype,
    ) -> HostTable | None:  # fmt: skip
        """The segments' projections of every layer for a native caller on the CPU that adds
        them itself, inputs of `dtype` (gpu_lora.host_runs.HostTable); None where this runner
        does not compute them in the caller's process, or not all with the native kernel."""
        ...


def add_deltas(
    runner: HostLoraRunner,
    layer: int,
    x: torch.Tensor,
    segments: list[tuple[int, int, int]],
    outputs: Sequence[tuple[str, torch.Tensor]],
) -> None:
    """`HostLoraRunner.add` through its `run`: the deltas, added into y over the segments'
    span (rows outside every segment are zero)."""
    # copy=False: the worker pool hands back views of its shared outputs, used at once here.
    # A device x goes as it is: the pool copies it down without a blocking synchronize.
    deltas = runner.run(layer, x, segments, tuple(m for m, _ in outputs), copy=False)
    lo = min(start for _, start, _ in segments)
    hi = max(end for _, _, end in segments)
    for module, y in outputs:
        delta = deltas.get(module)
        if delta is not None:
            y[lo:hi] += delta[lo:hi].to(device=y.device, dtype=y.dtype)


class HostLora:
    """`run(layer, x, segments, modules)` over an id -> LoraAdapter table (read live)."""

    def __init__(self, adapters: dict[int, LoraAdapter]):
        self.adapters = adapters
        # id -> (adapter, whether the native kernel reads its tensors as they lie): checked once
        # an adapter (they are never written in place), kept while the id is in `adapters`
        self._layouts: dict[int, tuple[LoraAdapter, bool, set]] = {}
        # (segments, modules, dtype, device) -> (the native call, segments it leaves): a step's
        # layers share one; the last MAX_PLANS kept
        self._plans: dict[tuple, tuple[HostRuns | None, list]] = {}
        # Both tables change on the engine thread (a new plan) and on the adapter thread
        # (`forget`): under this lock; a plan is read without it (a dict lookup)
        self._lock = threading.Lock()

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

    def add(
        self,
        layer: int,
        x: torch.Tensor,
        segments: list[tuple[int, int, int]],
        outputs: Sequence[tuple[str, torch.Tensor]],
    ) -> None:
        """y += each segment's delta for each (module, y), in place: the native runs kernel
        over the segments whose tensors it reads as they lie (a CPU x, the adapter held at x's
        dtype, B^T contiguous), `run` for the others (see the module docstring)."""
        runs, slow = self._plan_of(segments, tuple(m for m, _ in outputs), x.dtype, x.device)
        if runs is not None and not runs(layer, x, outputs):
            slow = segments  # outputs it cannot write: all on the general path
        if slow:
            add_deltas(self, layer, x, slow, outputs)

    def native_table(
        self, segments: list[tuple[int, int, int]], modules: tuple[str, ...], num_layers: int,
        dtype: torch.dtype,
    ) -> HostTable | None:  # fmt: skip
        """See HostLoraRunner.native_table: the native call's `HostRuns.table`, where every
        segment's tensors are read as they lie."""
        runs, slow = self._plan_of(segments, modules, dtype, torch.device("cpu"))
        return None if runs is None or slow else runs.table(num_layers)

    def _plan_of(self, segments, modules, dtype, device) -> tuple[HostRuns | None, list]:
        """The plan of these segments and modules (`_plan`), kept: a step's layers share one."""
        key = (tuple(segments), modules, dtype, device.type)
        plan = self._plans.get(key)
        if plan is None:
            with self._lock:
                plan = self._plans[key] = self._plan(dtype, device, segments, modules)
                while len(self._plans) > MAX_PLANS:  # the oldest out: a step makes one an input
                    del self._plans[next(iter(self._plans))]
        return plan

    def forget(self, adapter_id: int) -> None:
        """Let go of what this runner keeps of an adapter no longer in `adapters` (its native
        calls hold its tensors). Any thread."""
        with self._lock:
            self._layouts.pop(adapter_id, None)
            self._plans = {
                k: v for k, v in self._plans.items() if all(s[0] != adapter_id for s in k[0])
            }

    def _plan(self, dtype, device, segments, modules) -> tuple[HostRuns | None, list]:
        """The native call for the segments it can compute from inputs of `dtype` on `device`
        and the rest (see `add`; under the lock)."""
        native_ok = device.type == "cpu" and native.available(dtype)
        fast, slow = [], []
        for adapter_id, start, end in segments:
            adapter = self.adapters[adapter_id]
            if native_ok and self._lies_as_pool(adapter, dtype):
                fast.append((adapter, start, end))
            else:
                slow.append((adapter_id, start, end))
        return (HostRuns(fast, modules) if fast else None), slow

    def _lies_as_pool(self, adapter: LoraAdapter, dtype: torch.dtype) -> bool:
        """Whether every A is contiguous, every B over a contiguous B^T, all at `dtype`
        (checked once an adapter: they are never written in place)."""
        known = self._layouts.get(adapter.id)
        if known is None or known[0] is not adapter:
            if len(self._layouts) > 2 * len(self.adapters):  # adapters gone, not forgotten
                self._layouts = {i: k for i, k in self._layouts.items() if i in self.adapters}
            pairs = adapter.weights.values()
            ok = bool(pairs) and all(a.is_contiguous() and b.T.is_contiguous() for a, b in pairs)
            dtypes = {t.dtype for pair in pairs for t in pair}
            known = self._layouts[adapter.id] = (adapter, ok and len(dtypes) == 1, dtypes)
        return known[1] and dtype in known[2]
