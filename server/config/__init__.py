"""Engine settings: four sub-configs whose fields carry their flags and checks (server.settings).

One module per part: runtime.py (device, dtype, kernels, threads), lora.py (adapter loading,
CPU workers, the emulated link), memory.py (the KV and adapter budget, prefix cache, host tier),
scheduling.py (queue policy, step budget); engine.py joins them in `EngineConfig`, one flat
frozen dataclass whose `part(cls)` gives a module only its part. `toppings-serve` generates its
flags from these classes and builds the config from what it parsed (server.cli_args); the same
checks run when code builds an `EngineConfig`. The names below are the package's: import them
from here.
"""

from __future__ import annotations

from toppings.server.config.engine import ENGINE_PARTS, EngineConfig
from toppings.server.config.lora import (
    PCIE4_X16_GBPS,
    PCIE4_X16_LATENCY_US,
    WORKER_SPINCOUNT,
    LoraConfig,
)
from toppings.server.config.memory import (
    AUTO_EVICTION,
    EVICTIONS,
    KV_EVENT_ENCODINGS,
    MEMORY_LAYOUTS,
    MemoryConfig,
)
from toppings.server.config.runtime import (
    DEVICES,
    DTYPE_CHOICES,
    DTYPES,
    KERNELS,
    LOAD_FORMATS,
    QUANTIZATIONS,
    LoadFormat,
    Quantization,
    RuntimeConfig,
)
from toppings.server.config.scheduling import QUEUE_POLICIES, SchedulingConfig

__all__ = [
    "AUTO_EVICTION", "DEVICES", "DTYPES", "DTYPE_CHOICES", "ENGINE_PARTS", "EVICTIONS", "KERNELS",
    "KV_EVENT_ENCODINGS", "LOAD_FORMATS", "MEMORY_LAYOUTS", "PCIE4_X16_GBPS",
    "PCIE4_X16_LATENCY_US", "QUANTIZATIONS", "QUEUE_POLICIES", "WORKER_SPINCOUNT", "EngineConfig",
    "LoadFormat", "LoraConfig", "MemoryConfig", "Quantization", "RuntimeConfig", "SchedulingConfig",
]  # fmt: skip
