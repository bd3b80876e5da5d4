"""Which LoRA kernels run: the implementations by name, and the one choice an engine makes.

`get_kernels(name)` gives the four functions of one implementation ("reference", "cpu",
"triton"), for tests and benchmarks that compare them. `select(kernel, device, dtype)` is the
only place that decides what an engine runs: it walks the device's row of `PREFERENCE` and takes
the first entry of `BACKENDS` that serves the kernel and dtype. On a GPU that is Triton; on a CPU
MBGMV runs the native C kernel over runs where it is built (`native`), and everything else the
torch kernels (`cpu`).
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from toppings.gpu_lora.kernels import native

_PKG = "toppings.gpu_lora.kernels"
IMPLEMENTATIONS = {  # name -> (module of the decode kernels, module of the prefill kernels)
    "reference": (f"{_PKG}.reference", f"{_PKG}.reference"),
    "cpu": (f"{_PKG}.cpu", f"{_PKG}.cpu"),
    "triton": (f"{_PKG}.triton_decode", f"{_PKG}.triton_prefill"),
}


class LoraKernel(enum.Enum):
    """--kernel: BGMV (Punica, every token padded to the batch's max rank) or MBGMV (S-LoRA)."""

    BGMV = "bgmv"
    MBGMV = "mbgmv"


class KernelFunctions(NamedTuple):
    """The four kernels of one implementation (signatures of `kernels.reference`)."""

    bgmv_decode: Callable[..., None]
    mbgmv_decode: Callable[..., None]
    bgmv_prefill: Callable[..., None]
    mbgmv_prefill: Callable[..., None]

    @property
    def table(self) -> dict[tuple[str, str], Callable[..., None]]:
        """KERNELS[(kernel, phase)], kernel in {"bgmv", "mbgmv"}, phase in {"decode", "prefill"}."""
        return {
            (kernel.value, phase): getattr(self, f"{kernel.value}_{phase}")
            for kernel in LoraKernel
            for phase in ("decode", "prefill")
        }


def get_kernels(name: str) -> KernelFunctions:
    """The kernels of implementation "reference", "cpu" or "triton" (imports its modules)."""
    if name not in IMPLEMENTATIONS:
        choices = sorted(IMPLEMENTATIONS)
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {choices}")
    decode_mod, prefill_mod = (importlib.import_module(m) for m in IMPLEMENTATIONS[name])
    return KernelFunctions(
        decode_mod.bgmv_decode,
        decode_mod.mbgmv_decode,
        prefill_mod.bgmv_prefill,
        prefill_mod.mbgmv_prefill,
    )


@dataclass(frozen=True)
class LoraBackend:
    """The LoRA kernels of one engine, chosen once by `select`.

    decode / prefill: the kernel functions (signatures of `kernels.reference`); padded: BGMV
    (every adapter read over the batch's max rank) rather than MBGMV; segment_decode: what decode
    steps call instead of `decode`, with the prefill signature, over runs of one adapter's tokens
    (on a CPU, the fast path: `bench/results/cpu_decode_paths.json`); None: `decode` per token.
    runs_step: where set, what prefill and segment_decode steps build once a step,
    `runs_step({module: (lora_a [L, C, H_in], lora_b [L, C, H_out], ranks [B])}, seg_starts,
    offsets, scales)`, and call once per layer and input for every projection of that input,
    `step(layer, x, [(module, y), ...], skip)` (MBGMV over runs: `kernels.native.RunsStep`);
    None: one kernel call per projection. name: the `BACKENDS` entry it came from.
    """

    name: str
    decode: Callable
    prefill: Callable
    padded: bool
    segment_decode: Callable | None = None
    runs_step: Callable | None = None


def _pair(functions: KernelFunctions, kernel: LoraKernel) -> tuple[Callable, Callable]:
    """(decode, prefill) of `kernel` among `functions`."""
    table = functions.table
    return table[(kernel.value, "decode")], table[(kernel.value, "prefill")]


def _triton(kernel: LoraKernel, dtype: torch.dtype) -> LoraBackend:
    decode, prefill = _pair(get_kernels("triton"), kernel)
    return LoraBackend("triton", decode, prefill, padded=kernel is LoraKernel.BGMV)


def _cpu(kernel: LoraKernel, dtype: torch.dtype) -> LoraBackend:
    decode, prefill = _pair(get_kernels("cpu"), kernel)
    return LoraBackend(
        "cpu", decode, prefill, padded=kernel is LoraKernel.BGMV, segment_decode=prefill
    )


def _native(kernel: LoraKernel, dtype: torch.dtype) -> LoraBackend | None:
    """MBGMV over runs in one native call per layer and input; None where it cannot run."""
    if kernel is not LoraKernel.MBGMV or not native.available(dtype):
        return None
    decode, _ = _pair(get_kernels("cpu"), kernel)
    return LoraBackend(
        "native", decode, native.mbgmv_runs, padded=False,
        segment_decode=native.mbgmv_runs, runs_step=native.RunsStep,
    )  # fmt: skip


# name -> (kernel, pool dtype) -> the backend, or None where it cannot serve them here
BACKENDS: dict[str, Callable[[LoraKernel, torch.dtype], LoraBackend | None]] = {
    "triton": _triton,
    "native": _native,
    "cpu": _cpu,
}
PREFERENCE = {"cuda": ("triton",), "cpu": ("native", "cpu")}  # device -> BACKENDS, best first


def select(kernel: str | LoraKernel, device: str, dtype: torch.dtype) -> LoraBackend:
    """The backend an engine runs: kernel "bgmv"/"mbgmv", device "cpu"/"cuda", the pool dtype."""
    try:
        kernel = LoraKernel(kernel)
    except ValueError:
        raise ValueError(f"unknown LoRA kernel {kernel!r}") from None
    if device not in PREFERENCE:
        raise ValueError(f"unknown device {device!r}; choose one of {sorted(PREFERENCE)}")
    for name in PREFERENCE[device]:
        backend = BACKENDS[name](kernel, dtype)
        if backend is not None:
            return backend
    raise ValueError(f"no LoRA backend serves {kernel.value} on {device} in {dtype}")
