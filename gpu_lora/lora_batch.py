"""The LoRA side of one engine step: where each request's delta is computed, layer by layer.

Built once per step (pool offsets are the same in every layer) and called by the model after each
base projection: `add(layer, x, ((module, y), ...))` adds every request's delta into y in place.
A request whose adapter is still loading (Toppings' CPU-assisted mode) reads its ticket at every
layer: layers already resident run on the device with the others, the rest go to the host
(`cpu_lora` workers, or the in-process `HostLora`) in one call per layer and input, covering every
projection that shares that input. Decode on a CPU device with every adapter resident uses the
masked dense plan of `dense_decode` where that is faster; the rest calls the kernels. Which path
and kernels run is decided once per engine (`LoraKernels.choose`), never per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from toppings.gpu_lora.adapter_pool import AdapterPool, ResidentAdapter
from toppings.gpu_lora.dense_decode import DenseDecodePlan
from toppings.gpu_lora.host_lora import HostLoraRunner
from toppings.gpu_lora.kernels import get_kernels
from toppings.gpu_lora.loader import LoadTicket

# (kernel, dtype) where the masked dense decode plan beats the grouped CPU kernels.
DENSE_DECODE_WINS = {("mbgmv", torch.bfloat16)}


@dataclass(frozen=True)
class LoraKernels:
    """The LoRA kernels of one engine, chosen once from --kernel and the device.

    decode / prefill: the kernel functions (signatures of `kernels.reference`); padded: BGMV
    (every adapter read over the batch's max rank) rather than MBGMV; dense_decode: a decode
    step whose adapters are all resident uses the masked dense plan, where it is the faster CPU
    path (`bench/results/cpu_decode_paths.json`: MBGMV in bfloat16 only, 0.53x the grouped
    kernels' time; 1.2x-3.2x slower for BGMV or float32).
    """

    decode: Callable
    prefill: Callable
    padded: bool
    dense_decode: bool

    @classmethod
    def choose(cls, kernel: str, device: str, dtype: torch.dtype) -> LoraKernels:
        """kernel: "bgmv" or "mbgmv"; device: "cpu" or "cuda"; dtype: the adapter pool's."""
        if kernel not in ("bgmv", "mbgmv"):
            raise ValueError(f"unknown LoRA kernel {kernel!r}")
        backend = get_kernels("triton" if device == "cuda" else "cpu")
        decode, prefill = {
            "bgmv": (backend.bgmv_decode, backend.bgmv_prefill),
            "mbgmv": (backend.mbgmv_decode, backend.mbgmv_prefill),
        }[kernel]
        dense = device == "cpu" and (kernel, dtype) in DENSE_DECODE_WINS
        return cls(decode, prefill, padded=kernel == "bgmv", dense_decode=dense)


@dataclass
class HostLoraStats:
    """Host LoRA calls of an engine and the wall time they took (for /metrics)."""

    calls: int = 0
    seconds: float = 0.0


class LoraBatch:
    """Per-module offsets, ranks and scales of the B requests of a step, and their tickets."""

    def __init__(
        self,
        pool: AdapterPool,
        kernels: LoraKernels,
        adapters: list[ResidentAdapter | None],
        seg_starts: list[int],
        is_prefill: bool,
        tickets: list[LoadTicket | None] | None = None,
        host: HostLoraRunner | None = None,
        host_stats: HostLoraStats | None = None,
    ):
        self.pool = pool
        self.is_prefill = is_prefill
        self.host_stats = host_stats if host_stats is not None else HostLoraStats()
        self._adapters = adapters
        self._seg_starts_list = seg_starts
        loading = [i for i, t in enumerate(tickets or []) if t is not None and not t.done]
        self._loading = [(i, tickets[i]) for i in loading]
        self._host = host
        self._dense = None
        if not is_prefill and kernels.dense_decode and not loading:
            self._dense = DenseDecodePlan(pool, adapters, padded=kernels.padded)
            return
        device = pool.device
        self._seg_starts = torch.tensor(seg_starts, dtype=torch.int32, device=device)
        self._fn = kernels.prefill if is_prefill else kernels.decode
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

    def add(self, layer: int, x: torch.Tensor, outputs) -> None:
        """y += LoRA delta for each (module, y) pair; x [T, H_in], y [T, H_out], in place."""
        if self._dense is not None:
            for module, y in outputs:
                self._dense.add(module, layer, x, y)
            return
        not_ready = [i for i, t in self._loading if t.layers_ready() <= layer]
        for module, y in outputs:
            args = self._args.get(module)
            if args is None:
                continue
            offsets, ranks, scales, max_rank = args
            if not_ready:
                ranks = ranks.clone()
                ranks[not_ready] = 0  # these requests' rows of this layer are not there yet
            a = self.pool.lora_a[module][layer]  # [C, H_in]
            b = self.pool.lora_b[module][layer]  # [C, H_out]
            lead = (self._seg_starts,) if self.is_prefill else ()
            # max_rank: BGMV's padding; for MBGMV only a bound that spares a device sync.
            self._fn(y, x, a, b, *lead, offsets, ranks, scales, max_rank)
        if not_ready:
            self._add_on_host(layer, x, outputs, not_ready)

    def _add_on_host(self, layer: int, x: torch.Tensor, outputs, not_ready: list[int]) -> None:
        """One host call for every projection of this input, for the requests still loading."""
        starts = self._seg_starts_list
        segments = [(self._adapters[i].name, starts[i], starts[i + 1]) for i in not_ready]
        modules = tuple(m for m, _ in outputs if m in self._args)
        if not modules:
            return
        begin = time.perf_counter()
        # copy=False: the worker pool hands back views of its shared outputs, used at once here.
        # A device x goes as it is: the pool copies it down without a blocking synchronize.
        deltas = self._host.run(layer, x.detach(), segments, modules, copy=False)
        self.host_stats.seconds += time.perf_counter() - begin
        self.host_stats.calls += 1
        # Rows outside the loading requests' span are zero: add only the span.
        lo = min(start for _, start, _ in segments)
        hi = max(end for _, _, end in segments)
        for module, y in outputs:
            delta = deltas.get(module)
            if delta is not None:
                y[lo:hi] += delta[lo:hi].to(device=y.device, dtype=y.dtype)
