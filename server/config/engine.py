"""`EngineConfig`: the four parts of one server's engine settings in one flat frozen dataclass
(`config.max_batch_size`, `config.memory_bytes`, ...); `config.part(MemoryConfig)` is the
`MemoryConfig` of its values, so that each module receives only its part."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypeVar

from toppings.server.config.lora import LoraConfig
from toppings.server.config.memory import MemoryConfig
from toppings.server.config.runtime import RuntimeConfig
from toppings.server.config.scheduling import SchedulingConfig
from toppings.server.settings import Settings

Part = TypeVar("Part", bound=Settings)


@dataclass(frozen=True)
class EngineConfig(RuntimeConfig, LoraConfig, MemoryConfig, SchedulingConfig):
    """How one inference server runs its engine: every field of the four sub-configs, flat."""

    def part(self, cls: type[Part]) -> Part:
        """The sub-config `cls` (one of ENGINE_PARTS) holding this config's values of its
        fields, and only those."""
        if cls not in ENGINE_PARTS:
            raise TypeError(f"{cls.__name__} is not a part of EngineConfig")
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})


ENGINE_PARTS: tuple[type[Settings], ...] = (
    RuntimeConfig,
    LoraConfig,
    MemoryConfig,
    SchedulingConfig,
)
