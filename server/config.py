"""Engine settings: four sub-configs whose fields carry their flags and checks (server.settings).

`EngineConfig` is all four in one flat frozen dataclass (`config.max_batch_size`,
`config.memory_bytes`, ...). Each module receives only its part: `config.part(MemoryConfig)` is
the `MemoryConfig` of this config's values, which has no other part's fields.
`toppings-serve` generates its flags from these classes and builds the config from what it
parsed (server.cli_args); the same checks run when code builds an `EngineConfig`.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass
from typing import TypeVar

from toppings.gpu_lora.eviction import EVICTION_POLICIES
from toppings.server.lora_modes import LORA_MODES
from toppings.server.settings import (
    ON_OFF,
    Bound,
    Flag,
    Settings,
    on_off,
    parse_cores,
    positive,
    setting,
)

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = (*DTYPES, "auto")  # auto: resolved for the machine at start-up (runtime.py)
KERNELS = ("bgmv", "mbgmv")
# The emulated link's default per-transfer latency (--link-latency-us), after a PCIe 4.0 x16
# host-to-device copy: the bus of FastLibra's testbed (its Table, "PCIe x16 Gen4.0") and of the
# A100 that Toppings measures its loads on (Fig. 4, "tens of milliseconds depending on the
# adapter size and PCIe bandwidth"). Neither paper prints the pair; these are the usual
# measurements of that bus (CUDA bandwidthTest, pinned memory): about 25 GB/s (200 Gbit/s) of
# the 31.5 GB/s raw, and about 10 us from the launch of a copy to its first byte.
PCIE4_X16_GBPS = 200.0
PCIE4_X16_LATENCY_US = 10.0
QUEUE_POLICIES = ("fcfs", "chameleon")  # the classes: server.sched.policies
MEMORY_LAYOUTS = ("pool", "static")  # the layouts: server.memory.layout
AUTO_EVICTION = "auto"  # the memory layout's own policy (server.memory.layout)
EVICTIONS = (AUTO_EVICTION, *EVICTION_POLICIES)  # the classes: gpu_lora.eviction
KV_EVENT_ENCODINGS = ("array", "map")  # server.kv_events.schema.EventEncoding
# libgomp's spin rounds before an idle OpenMP thread sleeps, which toppings-serve sets with
# --cpu-workers (its default is 300,000; each round a pause instruction)
WORKER_SPINCOUNT = "30000"

Part = TypeVar("Part", bound=Settings)


class LoadFormat(enum.Enum):
    """Where the base model's weights come from (server.model.loader reads them)."""

    AUTO = "auto"  # the checkpoint's safetensors, one file or shards (the only format read)
    SAFETENSORS = "safetensors"
    DUMMY = "dummy"  # random weights of the checkpoint's shapes; only config.json is read


LOAD_FORMATS = tuple(f.value for f in LoadFormat)


class Quantization(enum.Enum):
    """How the base model's projections hold their weights (server.model.quant)."""

    NONE = "none"  # in the activation dtype (--dtype)
    INT8 = "int8"  # weight-only int8, one symmetric scale per output channel
    INT4 = "int4"  # weight-only int4, groups of 32 inputs with a scale and a zero each


QUANTIZATIONS = tuple(q.value for q in Quantization)


@dataclass(frozen=True)
class RuntimeConfig(Settings):
    """Where and how the model runs."""

    title = "device and runtime"

    device: str = setting("cpu", choices=DEVICES, flag=Flag())
    dtype: str = setting(
        "bfloat16",
        choices=DTYPE_CHOICES,
        flag=Flag(
            "auto (default): bfloat16 on cuda; on a cpu, bfloat16 where it multiplies natively "
            "and the model's projections run faster in it (measured at start-up), else float32",
            default="auto",
        ),
    )
    kernel: str = setting("mbgmv", choices=KERNELS, flag=Flag())
    load_format: str = setting(
        "auto",
        choices=LOAD_FORMATS,
        flag=Flag(
            "auto/safetensors: the checkpoint's safetensors (one file, or the shards of "
            "model.safetensors.index.json); dummy: random weights of the checkpoint's shapes "
            "from its config.json alone, for benchmarks"
        ),
    )
    quantization: str = setting(
        "none",
        choices=QUANTIZATIONS,
        flag=Flag(
            "weight-only quantization of the base model's projections (q/k/v/o/gate/up/down and "
            "lm_head; embeddings and norms stay in --dtype, LoRA runs in --dtype): int8, one "
            "scale per output channel; int4, groups of 32 inputs (lm_head int8); from the "
            "checkpoint's float weights at load, or a GGUF's Q8_0 / Q4_0 / Q4_1 blocks. "
            "--device cpu only",
        ),
    )
    # Decode steps replay CUDA graphs; None: on for cuda.
    cuda_graphs: bool | None = setting(
        None,
        flag=Flag(
            "decode steps replay CUDA graphs captured per batch-size bucket (default: on with "
            "--device cuda; refused with --device cpu)",
            choices=ON_OFF,
            parse=on_off,
        ),
    )
    # Every Triton LoRA kernel variant compiled before /health answers (model/kernel_warmup.py);
    # None: on for cuda.
    warmup: bool | None = setting(
        None,
        flag=Flag(
            "compile every Triton LoRA kernel variant the server can launch (each rank bucket, "
            "token tile and projection shape, decode and prefill) at start-up, before /health "
            "answers, and log their count and time; a kept TRITON_CACHE_DIR makes the next "
            "start-up load them (default: on with --device cuda; refused with --device cpu, "
            "which runs no Triton)",
            choices=ON_OFF,
            parse=on_off,
        ),
    )
    # The next step planned while the device runs this one (engine/step_pipeline.py); None: on
    # for cuda.
    async_scheduling: bool | None = setting(
        None,
        flag=Flag(
            "plan the next step and read its inputs while the device runs this one; the model "
            "runs on a thread of its own (default: on with --device cuda; off on a cpu, where "
            "the host's work and the model's share the cores)",
            choices=ON_OFF,
            parse=on_off,
        ),
    )
    # torch (OpenMP) threads of the engine thread; 0: every core.
    num_threads: int = setting(
        0,
        bound=Bound.NON_NEGATIVE,
        flag=Flag(
            "OpenMP threads of the engine's compute (0: torch's default, every core); leave "
            "cores to --cpu-workers on a CPU-only node",
            name="--torch-threads",
            type=int,
            metavar="N",
        ),
    )
    # The engine's thread count chosen from its decode steps (process/thread_governor.py);
    # None: on for cpu.
    adapt_threads: bool | None = setting(
        None,
        flag=Flag(
            "run the engine's steps on half its threads while that measures faster (a "
            "neighbour taking a core), all of them again when that does: decode steps are "
            "compared now and then (default: on with --device cpu)",
            choices=ON_OFF,
            parse=on_off,
        ),
    )
    max_model_len: int = setting(0, bound=Bound.NON_NEGATIVE)  # 0: max_position_embeddings

    def check(self) -> None:
        if self.cuda_graphs and self.device != "cuda":
            raise ValueError("cuda_graphs needs device cuda (a CPU has no graphs to capture)")
        if self.warmup and self.device != "cuda":
            raise ValueError("warmup needs device cuda (a CPU runs no Triton kernels)")
        if self.adapt_threads and self.device != "cpu":
            raise ValueError("adapt_threads needs device cpu (it sizes the CPU's OpenMP team)")
        if self.adapt_threads and self.async_scheduling:
            raise ValueError(
                "adapt_threads sizes the engine thread's team; with "
                "async_scheduling the model runs on the device lane: choose one"
            )
        if self.quantization != Quantization.NONE.value and self.device != "cpu":
            raise ValueError(
                f"quantization {self.quantization} runs on device cpu only (torch's packed "
                "int8/int4 CPU kernels); use quantization none on cuda"
            )

    @property
    def quantization_scheme(self) -> Quantization:
        """The quantization as its Enum."""
        return Quantization(self.quantization)

    @property
    def use_thread_governor(self) -> bool:
        """Whether the engine's thread count follows its steps (process/thread_governor.py;
        not with async scheduling, where the model runs on the device lane's thread)."""
        return self.device == "cpu" and self.adapt_threads is not False and not self.use_async

    @property
    def use_async(self) -> bool:
        """Whether the engine plans ahead of the device (server/engine/step_pipeline.py)."""
        if self.async_scheduling is None:
            return self.device == "cuda"
        return self.async_scheduling

    @property
    def use_warmup(self) -> bool:
        """Whether the Triton LoRA kernels are compiled at start-up (model/kernel_warmup.py)."""
        return self.device == "cuda" and self.warmup is not False

    @property
    def use_cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs (server/model/cuda_graphs.py)."""
        return self.device == "cuda" and self.cuda_graphs is not False


@dataclass(frozen=True)
class LoraConfig(Settings):
    """How adapters reach the device, and the CPU workers that compute LoRA on the host."""

    title = "LoRA adapters"

    lora_mode: str = setting(
        "on-demand",
        choices=LORA_MODES,
        flag=Flag("how a request whose adapter is not on the device starts"),
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

    def check(self) -> None:
        if not self.adapter_cache and LORA_MODES[self.lora_mode].preload:
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
        allowed = os.sched_getaffinity(0)
        outside = sorted(set(self.device_cores + self.cpu_cores) - allowed)
        if outside:
            raise ValueError(
                f"cores {_core_list(outside)} of device_cores {device} / cpu_cores {host} are "
                f"not among the cores this process may run on ({_core_list(sorted(allowed))})"
            )
        if LORA_MODES[self.lora_mode].host_workers and not self.num_cpu_workers:
            raise ValueError(
                f"device_cores with lora_mode {self.lora_mode} needs num_cpu_workers >= 1: "
                "without workers host LoRA runs on the engine thread, a device core"
            )

    @property
    def host_cores(self) -> tuple[int, ...]:
        """The cores of the host side (CPU workers, adapter loader) when the device/host split
        is on; () without it (they run anywhere)."""
        return self.cpu_cores if self.device_cores else ()


@dataclass(frozen=True)
class MemoryConfig(Settings):
    """Device memory for KV blocks and adapters, and the host tier behind it.

    With memory_layout "pool" (memory/manager.py), one budget of memory_bytes holds KV blocks
    and adapter weights. memory_bytes 0: on CUDA a share of the free device memory; on a CPU
    max_total_tokens of KV plus adapter_cache_bytes, and when that is 0 too, adapters are not
    charged (no limit). "static" splits memory in two: max_total_tokens of KV and
    adapter_cache_bytes of adapters. A request is admitted only when its prompt plus
    max_new_tokens fit in what is not yet promised.
    """

    title = "memory"

    max_total_tokens: int = setting(
        32768,
        bound=Bound.POSITIVE,
        flag=Flag(
            "KV cache size in tokens over all requests (the pool's default budget: see "
            "--memory-bytes)",
            type=int,
        ),
    )
    memory_layout: str = setting(
        "pool",
        choices=MEMORY_LAYOUTS,
        flag=Flag(
            "pool: one memory budget for KV blocks and adapters, which live in what KV does "
            "not use (ELORA/FastLibra); static: a fixed split, --max-total-tokens of KV and "
            "--adapter-cache-bytes of adapters"
        ),
    )
    # The pool's budget; 0: see the class docstring.
    memory_bytes: int = setting(
        0,
        bound=Bound.NON_NEGATIVE,
        flag=Flag(
            "the pool's budget (0: 40%% of the free device memory on cuda; on a cpu "
            "--max-total-tokens of KV plus --adapter-cache-bytes, adapters unlimited when that "
            "is 0)",
            type=int,
            metavar="N",
        ),
    )
    # Reuse cached KV prefixes under the same adapter.
    prefix_cache: bool = setting(
        True,
        flag=Flag(
            "reuse cached KV of a prompt's prefix, under the request's own adapter only (an "
            "activated LoRA's blocks before its activation: under the base model)",
            choices=ON_OFF,
            default="on",
            parse=on_off,
        ),
    )
    # Host tier for KV blocks swapped out; 0: dropped instead.
    host_memory_bytes: int = setting(
        0,
        bound=Bound.NON_NEGATIVE,
        flag=Flag(
            "host tier for KV blocks leaving the device (swapped back in on a hit when that "
            "beats recomputing them; --link-gbps throttles it on a cpu); 0: they are dropped",
            type=int,
            metavar="N",
        ),
    )
    # What leaves the device first, adapters and KV alike, in either layout (gpu_lora.eviction).
    eviction: str = setting(
        AUTO_EVICTION,
        choices=EVICTIONS,
        flag=Flag(
            "which cached item leaves the device first when room is needed, idle adapters and "
            "cached KV blocks alike, in either --memory-layout: lru, chameleon (frequency, "
            "recency and size), or fastlibra's cost model; auto: fastlibra with the pool "
            "layout, lru with the static one. --memory-policy is the same flag",
            aliases=("--memory-policy",),
        ),
    )
    block_tokens: int = setting(
        16,
        bound=Bound.POSITIVE,
        flag=Flag("tokens per KV block", type=positive, metavar="N"),
    )
    # Where the prefix cache's KV events go, in vLLM's schema (server/kv_events); None: off.
    kv_events_endpoint: str | None = setting(
        None,
        flag=Flag(
            "publish the prefix cache's KV cache events (vLLM's BlockStored / BlockRemoved / "
            "AllBlocksCleared, each block hashed with its adapter's name) on a ZMQ PUB socket "
            "bound here, e.g. tcp://*:5557, for KV-aware routers (llm-d, Dynamo); off by default",
            metavar="ENDPOINT",
        ),
    )
    kv_events_replay_endpoint: str | None = setting(
        None,
        flag=Flag(
            "a ZMQ ROUTER socket bound here, e.g. tcp://*:5558, answers a consumer that missed "
            "batches with those kept since the sequence number it sends (vLLM's replay)",
            metavar="ENDPOINT",
        ),
    )
    kv_events_topic: str = setting(
        "kv-events", flag=Flag("the topic frame of each published KV events batch")
    )
    kv_events_encoding: str = setting(
        "array",
        choices=KV_EVENT_ENCODINGS,
        flag=Flag(
            "array: every event positional, the layout all vLLM consumers decode; map: each "
            "event a map tagged under 'type', as vLLM sends since its PR #42892"
        ),
    )

    def check(self) -> None:
        if self.kv_events_endpoint and not self.prefix_cache:
            raise ValueError("kv_events_endpoint needs prefix_cache on: the events are its own")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")


@dataclass(frozen=True)
class SchedulingConfig(Settings):
    """Which waiting request runs next, and how large a step may be."""

    title = "scheduling"

    max_batch_size: int = setting(128, bound=Bound.POSITIVE, flag=Flag(type=int))
    max_prefill_tokens: int = setting(8192, bound=Bound.POSITIVE)
    # Which waiting request goes next (server.sched.policies).
    queue_policy: str = setting(
        "chameleon",
        choices=QUEUE_POLICIES,
        flag=Flag(
            "which waiting request is admitted next: chameleon's adapter-aware multi-level "
            "queues with token quotas (bench/results/queueing.json: 1.12x the load FCFS "
            "sustains within the TTFT SLO), or fcfs, arrival order"
        ),
    )
    # Mixed steps of decodes and prompt chunks under a token budget (server.sched.scheduler).
    chunked_prefill: bool = setting(
        True,
        flag=Flag(
            "chunked prefill: each step runs every decode first, then prompt chunks up to "
            "--max-num-batched-tokens, so a long prompt no longer stalls the running streams",
            choices=ON_OFF,
            default="on",
            parse=on_off,
        ),
    )
    # The token budget of a chunked-prefill step; 0: derived (server.sched.step_budget).
    max_num_batched_tokens: int = setting(
        0,
        bound=Bound.NON_NEGATIVE,
        flag=Flag(
            "tokens one chunked-prefill step computes, decodes included (more than "
            "--max-batch-size); 0: sized for --itl-target-ms from the modelled step time, "
            "per number of decodes, logged at start-up",
            type=int,
            metavar="N",
        ),
    )
    # The inter-token SLO a chunked-prefill step is sized for (server.sched.step_budget's
    # ITL_TARGET_MS: a fixed value, not a multiple of the step the engine runs).
    itl_target_ms: float = setting(
        150.0,
        bound=Bound.POSITIVE,
        flag=Flag(
            "inter-token SLO the default --max-num-batched-tokens is sized for: a step with "
            "decodes takes the prompt tokens that keep its modelled time within it; beside at "
            "most 8 decodes a chunk is at least 256 tokens, and a step without decodes takes "
            "whole prompts",
            type=float,
            metavar="X",
        ),
    )
    # The TTFT SLO Chameleon's queue quotas are sized for.
    ttft_slo_ms: float = setting(
        5000.0,
        bound=Bound.POSITIVE,
        flag=Flag(
            "the TTFT SLO that chameleon's queue quotas are sized for", type=float, metavar="X"
        ),
    )

    def check(self) -> None:
        if self.chunked_prefill and 0 < self.max_num_batched_tokens <= self.max_batch_size:
            raise ValueError(
                "max_num_batched_tokens must exceed max_batch_size: a step's decodes come "
                "first, and prompt chunks need tokens left after them"
            )


@dataclass(frozen=True)
class EngineConfig(RuntimeConfig, LoraConfig, MemoryConfig, SchedulingConfig):
    """How one inference server runs its engine: every field of the four sub-configs, flat."""

    def part(self, cls: type[Part]) -> Part:
        """The sub-config `cls` (one of ENGINE_PARTS) holding this config's values of its
        fields, and only those."""
        if cls not in ENGINE_PARTS:
            raise TypeError(f"{cls.__name__} is not a part of EngineConfig")
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})


def _core_list(cores) -> str:
    return ",".join(str(c) for c in cores)


ENGINE_PARTS: tuple[type[Settings], ...] = (
    RuntimeConfig,
    LoraConfig,
    MemoryConfig,
    SchedulingConfig,
)
