"""Build a ready-to-serve engine from command-line level inputs."""

from __future__ import annotations

import logging

from toppings.server.config import EngineConfig
from toppings.server.engine import Engine
from toppings.server.loader import load_checkpoint

log = logging.getLogger(__name__)


def build_engine(model: str, config: EngineConfig, loras: dict[str, str] | None = None) -> Engine:
    """Load the base model and adapters and start the engine thread."""
    checkpoint = load_checkpoint(model)
    engine = Engine(config, checkpoint)
    for name, path in (loras or {}).items():
        engine.add_adapter(name, path)
    engine.start()
    log.info(
        "engine ready: %s on %s (%s), %d adapters",
        engine.model_name,
        config.device,
        config.dtype,
        len(engine.adapters()),
    )
    return engine
