"""How adapters reach the device and the CPU workers that compute LoRA on the host
(`LoraConfig`, one part of server.config.EngineConfig)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from toppings.server.lora_modes import AUTO, LORA_MODES, pick_mode
from toppings.server.settings import (
    ON_OFF,
    Bound,
    Flag,
    Settings,
    on_off,
    parse_cores,
    process_cores,
    setting,
)

# The emulated link's default per-transfer latency (--link-latency-us), after a PCIe 4.0 x16
# host-to-device copy: the bus of FastLibra's testbed (its Table, "PCIe x16 Gen4.0") and of the
# A100 that Toppings measures its loads on (Fig. 4, "tens of milliseconds depending on the
# adapter size and PCIe bandwidth"). Neither paper prints the pair; these are the usual
# measurements of that bus (CUDA bandwidthTest, pinned memory): about 25 GB/s (200 Gbit/s) of
# the 31.5 GB/s raw, and about 10 us from the launch of a copy to its first byte.
PCIE4_X16_GBPS = 200.0
PCIE4_X16_LATENCY_US = 10.0
# libgomp's spin rounds before an idle OpenMP thread sleeps, which toppings-serve sets with
# --cpu-workers (its default is 300,000; each round a pause instruction)
WORKER_SPINCOUNT = "30000"


@dataclass(frozen=True)
class LoraConfig(Settings):
    """How adapters reach the device, and the CPU workers that compute LoRA on the host."""

    title = "LoRA adapters"

    lora_mode: str = setting(
        AUTO,
        choices=(*LORA_MODES, AUTO),
        flag=Flag(
            "how a request whose adapter is not on the device starts; auto: cpu-assisted on a "
            "CPU device (without --device-cores, or with --cpu-workers), on-demand on cuda"
        ),
    )
    # Device bytes for adapter weights; 0: no limit.
    adapter_cache_bytes: int = setting(
        0,
        bound=Bound.NON_NEGATIVE,
        flag=Flag(
            "device bytes for adapter weights (0: no limit); beyond it adapters are evicted",
            type=int,
            metavar="N",
        ),
    )
    # Host bytes all registered adapters may hold, one copy per content; 0: a share of the
    # machine's memory (gpu_lora/host_memory.py).
    adapter_host_bytes: int = setting(
        0,
        bound=Bound.NON_NEGATIVE,
        flag=Flag(
            "host bytes the registered adapters may hold together (their weights and CPU "
            "workers' copies; the same files under several names count once); a load past it "
            "gets 507. 0 (default): a quarter of this machine's memory",
            type=int,
            metavar="N",
        ),
    )
    # Largest LoRA rank served; 0: derived from the adapter budget (adapters/reader.py).
    max_lora_rank: int = setting(
        0,
        bound=Bound.NON_NEGATIVE,
        flag=Flag(
            "largest rank an adapter may have; a higher one is refused with a 400 before its "
            "weights are read. 0 (default): the largest power of two at which an adapter on "
            "one projection of every layer (the smallest that rank can take) fits the adapter "
            "budget (--adapter-cache-bytes, else the pool's memory), at most 512; 256 when "
            "adapters have no budget",
            type=int,
            metavar="R",
        ),
    )
    # Whether adapters no request holds stay on the device (gpu_lora/cache.py).
    adapter_cache: bool = setting(
        True,
        flag=Flag(
            "off: an adapter leaves the device when its last request ends and nothing is "
            "prefetched (on-demand loading without a cache, S-LoRA's; with --lora-mode on-demand "
            "or cpu-assisted)",
            choices=ON_OFF,
            default="on",
            parse=on_off,
        ),
    )
    # CPU device only: throttle adapter loads to emulate a link; 0: off.
    link_gbps: float = setting(
        0.0,
        bound=Bound.NON_NEGATIVE,
        flag=Flag(
            "--device cpu only: throttle adapter loads to emulate a link of X Gbit/s (0: off; "
            f"{PCIE4_X16_GBPS:g} is a PCIe 4.0 x16 bus as measured)",
            type=float,
            metavar="X",
        ),
    )
    # The emulated link's latency per layer-group copy (only with link_gbps).
    link_latency_us: float = setting(
        PCIE4_X16_LATENCY_US,
        bound=Bound.NON_NEGATIVE,
        flag=Flag(
            "--device cpu with --link-gbps: each layer group's copy also pays US microseconds "
            "of per-transfer latency (default: a PCIe 4.0 x16 bus as measured)",
            type=float,
            metavar="US",
        ),
    )
    layers_per_group: int = setting(1, bound=Bound.POSITIVE)  # layers per pipelined load step
    # CPU LoRA worker processes; 0: compute host LoRA in-process.
    num_cpu_workers: int = setting(
        0,
        bound=Bound.NON_NEGATIVE,
        flag=Flag(
            "CPU worker processes for cpu-assisted LoRA (0: host LoRA runs in-process); with "
            f"workers, toppings-serve sets GOMP_SPINCOUNT={WORKER_SPINCOUNT} unless it is set, so "
            "that the engine's idle OpenMP threads soon sleep and leave the cores to them",
            name="--cpu-workers",
            type=int,
            metavar="N",
        ),
    )
    # Cores for the CPU workers (one each); (): any.
    cpu_cores: tuple[int, ...] = setting(
        (),
        flag=Flag(
            "cores the CPU workers are pinned to, one each, e.g. 4,5,6 or 4-6",
            type=parse_cores,
            metavar="LIST",
        ),
    )
    # The device side of a CPU-only node's device/host split; (): no split.
    device_cores: tuple[int, ...] = setting(
        (),
        flag=Flag(
            "pin the engine's forward pass (the engine thread and its OpenMP threads) to these "
            "cores, e.g. 0-3; the CPU workers and the adapter loader then run on --cpu-cores "
            "only, which must be given and disjoint from these",
            type=parse_cores,
            metavar="LIST",
        ),
    )
    # The engine and workers spin this long on a semaphore before sleeping.
    cpu_spin_us: float = setting(
        0.0,
        bound=Bound.NON_NEGATIVE,
        flag=Flag(
            "the engine and the CPU workers spin up to US microseconds on their semaphores "
            "before sleeping: cuts a layer call's overhead when the engine thread and every "
            "worker have a core of their own (e.g. 5000 on a GPU node); leave 0 when they share "
            "cores",
            type=float,
            metavar="US",
        ),
    )

    # How long a layer call waits for a CPU worker's slice before it takes the worker for hung.
    cpu_worker_timeout: float = setting(
        10.0,
        bound=Bound.POSITIVE,
        flag=Flag(
            "a CPU LoRA worker whose slice of a layer call takes longer than S seconds is taken "
            "for hung (stopped, starved): it is replaced and its slice computed in the server; "
            "every request of the step waits that long first, so keep it above the slowest "
            "slice of a long prompt and well below a client's patience",
            type=float,
            metavar="S",
        ),
    )

    def check(self) -> None:
        if not math.isfinite(self.cpu_worker_timeout):  # inf: a hung worker never replaced
            raise ValueError("--cpu-worker-timeout must be a finite number of seconds")
        named = LORA_MODES.get(self.lora_mode)  # None: auto, which never preloads
        if not self.adapter_cache and named is not None and named.preload:
            raise ValueError(
                f"adapter_cache off needs a lora_mode that loads on demand: {self.lora_mode} "
                "keeps every adapter on the device"
            )
        if self.cpu_cores and len(self.cpu_cores) < self.num_cpu_workers:
            raise ValueError("cpu_cores must name at least one core per CPU worker")
        if self.device_cores:
            self._check_split()

    def _check_split(self) -> None:
        device, host = _core_list(self.device_cores), _core_list(self.cpu_cores)
        if not self.cpu_cores:
            raise ValueError(f"device_cores {device} needs cpu_cores: the host side's cores")
        both = sorted(set(self.device_cores) & set(self.cpu_cores))
        if both:
            raise ValueError(
                f"device_cores {device} and cpu_cores {host} overlap on {_core_list(both)}: "
                "the device and the host need disjoint cores"
            )
        allowed = process_cores()
        outside = sorted(set(self.device_cores + self.cpu_cores) - allowed)
        if outside:
            raise ValueError(
                f"cores {_core_list(outside)} of device_cores {device} / cpu_cores {host} are "
                f"not among the cores this process may run on ({_core_list(sorted(allowed))})"
            )
        named = LORA_MODES.get(self.lora_mode)  # None: auto, which picks on-demand here
        if named is not None and named.host_workers and not self.num_cpu_workers:
            raise ValueError(
                f"device_cores with lora_mode {self.lora_mode} needs num_cpu_workers >= 1: "
                "without workers host LoRA runs on the engine thread, a device core"
            )

    def mode_on(self, device: str) -> str:
        """The LoRA mode this config runs on `device` (`lora_mode`, `auto` picked)."""
        split_without_workers = bool(self.device_cores) and not self.num_cpu_workers
        return pick_mode(self.lora_mode, device, split_without_workers)

    @property
    def host_cores(self) -> tuple[int, ...]:
        """The cores of the host side (CPU workers, adapter loader) when the device/host split
        is on; () without it (they run anywhere)."""
        return self.cpu_cores if self.device_cores else ()


def _core_list(cores) -> str:
    return ",".join(str(c) for c in cores)
