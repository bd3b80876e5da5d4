"""The LoRA modes (`--lora-mode`) as one small policy table, and `auto`, the default.

A mode only says how a server treats an adapter that is not on the device yet; everything else
(cache, loader, kernels) is the same in all of them. `auto` is the mode measured best where
the server runs (`pick_mode`): cpu-assisted where the host computes a loading adapter's layers
beside the device (a CPU device whose host LoRA runs in process, or on workers of its own),
on-demand on a GPU, where cpu-assisted has not been measured yet (docs/benchmarks.md,
adapter_scale.json).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoraMode:
    """preload: every adapter is loaded and pinned on the device when it is registered (the
    ideal upper bound); wait_for_load: a request's prefill waits until its adapter is resident
    while the other requests go on; host_workers: layers still loading run on the host, in CPU
    worker processes when the server has any (Toppings' cpu-assisted mode); stall_for_load: a
    step waits for the loads of its requests' adapters, and so every request in it waits (S-LoRA
    as its code runs: the router awaits `load_adapters` before a new batch's prefill; kept for
    comparisons, `on-demand-sync`)."""

    preload: bool
    wait_for_load: bool
    host_workers: bool
    stall_for_load: bool = False


AUTO = "auto"

LORA_MODES: dict[str, LoraMode] = {
    "cached": LoraMode(preload=True, wait_for_load=False, host_workers=False),
    "on-demand": LoraMode(preload=False, wait_for_load=True, host_workers=False),
    "cpu-assisted": LoraMode(preload=False, wait_for_load=False, host_workers=True),
    "on-demand-sync": LoraMode(
        preload=False, wait_for_load=False, host_workers=False, stall_for_load=True
    ),
}


def pick_mode(name: str, device: str, split_without_workers: bool = False) -> str:
    """The mode `name` stands for on `device`: itself, or for AUTO cpu-assisted on a CPU device
    and on-demand elsewhere. split_without_workers: the CPU device's cores are split between the
    device and the host (--device-cores) but no worker runs on the host's: host LoRA would run
    on a device core, so AUTO is on-demand there too."""
    if name != AUTO:
        return name
    return "cpu-assisted" if device == "cpu" and not split_without_workers else "on-demand"
