"""Engine settings, built once from the command line."""

from __future__ import annotations

from dataclasses import dataclass

from toppings.gpu_lora.eviction import EVICTION_POLICIES
from toppings.server.engine.lora_modes import LORA_MODES
from toppings.server.memory.layout import MemoryLayout
from toppings.server.memory.policies import MEMORY_POLICIES

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = (*DTYPES, "auto")  # auto: resolved for the machine at start-up (runtime.py)
KERNELS = ("bgmv", "mbgmv")
QUEUE_POLICIES = ("fcfs", "chameleon")  # server.queue_policies holds the classes
MEMORY_LAYOUTS = tuple(m.value for m in MemoryLayout)  # server/memory/layout.py


@dataclass(frozen=True)
class EngineConfig:
    """How one inference server runs its engine.

    Memory (memory/manager.py): with memory_layout "pool", one budget of memory_bytes holds KV
    blocks and adapter weights. memory_bytes 0: on CUDA a share of the free device memory; on a
    CPU max_total_tokens of KV plus adapter_cache_bytes, and when that is 0 too, adapters are not
    charged (no limit, as before). "static" is the old split, max_total_tokens of KV and
    adapter_cache_bytes of adapters. A request is admitted only when its prompt plus
    max_new_tokens fit in what is not yet promised.
    """

    device: str = "cpu"
    dtype: str = "bfloat16"
    kernel: str = "mbgmv"
    lora_mode: str = "cached"
    max_total_tokens: int = 32768
    max_batch_size: int = 128
    max_prefill_tokens: int = 8192
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    adapter_cache_bytes: int = 0  # device bytes for adapter weights; 0: no limit
    eviction: str = "lru"
    link_gbps: float = 0.0  # CPU device only: throttle adapter loads to emulate a link; 0: off
    layers_per_group: int = 1  # layers per pipelined load step
    num_cpu_workers: int = 0  # CPU LoRA worker processes; 0: compute host LoRA in-process
    cpu_cores: tuple[int, ...] = ()  # cores for the CPU workers (one each); (): any
    cpu_spin_us: float = 0.0  # engine and workers spin this long on a semaphore before sleeping
    num_threads: int = 0  # torch (OpenMP) threads of the engine thread; 0: every core
    queue_policy: str = "fcfs"  # which waiting request goes next (server.queueing)
    ttft_slo_ms: float = 5000.0  # the TTFT SLO Chameleon's queue quotas are sized for
    memory_layout: str = "pool"  # "pool": one budget for KV and adapters; "static": split
    memory_bytes: int = 0  # the pool's budget; 0: see the class docstring
    prefix_cache: bool = True  # reuse cached KV prefixes under the same adapter
    host_memory_bytes: int = 0  # host tier for KV blocks swapped out; 0: dropped instead
    block_tokens: int = 16  # tokens per KV block
    memory_policy: str = "fastlibra"  # what leaves the pool first (server/memory/policies.py)
    cuda_graphs: bool | None = None  # decode steps replay CUDA graphs; None: on for cuda

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("device", self.device, DEVICES),
            ("dtype", self.dtype, DTYPE_CHOICES),
            ("kernel", self.kernel, KERNELS),
            ("lora_mode", self.lora_mode, LORA_MODES),
            ("queue_policy", self.queue_policy, QUEUE_POLICIES),
            ("memory_layout", self.memory_layout, MEMORY_LAYOUTS),
            ("memory_policy", self.memory_policy, tuple(MEMORY_POLICIES)),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
        for name in ("max_total_tokens", "max_batch_size", "max_prefill_tokens", "block_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        for name in ("max_model_len", "adapter_cache_bytes", "num_cpu_workers", "num_threads",
                     "memory_bytes", "host_memory_bytes"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.cpu_spin_us < 0:
            raise ValueError("cpu_spin_us must be >= 0")
        if not self.ttft_slo_ms > 0:
            raise ValueError("ttft_slo_ms must be positive")
        if self.link_gbps < 0 or self.layers_per_group < 1:
            raise ValueError("link_gbps must be >= 0 and layers_per_group >= 1")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}")
        if self.cpu_cores and len(self.cpu_cores) < self.num_cpu_workers:
            raise ValueError("cpu_cores must name at least one core per CPU worker")
        if self.cuda_graphs and self.device != "cuda":
            raise ValueError("cuda_graphs needs device cuda (a CPU has no graphs to capture)")

    @property
    def use_cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs (server/model/cuda_graphs.py)."""
        return self.device == "cuda" and self.cuda_graphs is not False
