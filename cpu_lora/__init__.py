"""Host adapter repository in POSIX shared memory and the CPU LoRA worker pool.

Knows nothing of the server: a model is anything with `num_layers` and `projection_shape()`,
an adapter anything shaped like gpu_lora's LoraAdapter (see shapes.py).
"""

from toppings.cpu_lora.pool import CallStats, CpuLoraPool
from toppings.cpu_lora.repository import HostRepository, RepositoryFullError
from toppings.cpu_lora.shapes import LORA_TARGETS

__all__ = ["CallStats", "CpuLoraPool", "HostRepository", "LORA_TARGETS", "RepositoryFullError"]
