"""Build a ready-to-serve engine from command-line level inputs."""

from __future__ import annotations

import dataclasses
import logging

from toppings.gpu_lora.trace import TraceRecorder
from toppings.server.config import EngineConfig
from toppings.server.engine.engine import Engine
from toppings.server.model.dtype import choose_dtype
from toppings.server.model.loader import load_checkpoint
from toppings.server.sched.step_budget import StepTimeModel

log = logging.getLogger(__name__)


def build_engine(
    model: str,
    config: EngineConfig,
    loras: dict[str, str] | None = None,
    trace: TraceRecorder | None = None,
    step_model: StepTimeModel | None = None,
) -> Engine:
    """Load the base model and adapters and start the engine thread (`dtype="auto"` is
    resolved here, for the model's own shapes: server.model.dtype; `trace`, `step_model`: see
    Engine). Raises CheckpointError for weights files that cannot be loaded, before any model
    is built."""
    checkpoint = load_checkpoint(model, config.load_format, quantization=config.quantization_scheme)
    if config.dtype == "auto":
        mc = checkpoint.config
        dtype, why = choose_dtype(
            config.device, mc.hidden_size, mc.intermediate_size,
            quantization=config.quantization_scheme,
        )  # fmt: skip
        log.info("dtype auto: %s (%s)", dtype, why)
        config = dataclasses.replace(config, dtype=dtype)
    engine = Engine(config, checkpoint, trace, step_model)
    for name, path in (loras or {}).items():
        engine.add_adapter(name, path)
    engine.start()
    num_adapters = len(engine.adapters())
    log.info(
        "engine ready: %s on %s (%s, base weights %s), %d adapter%s",
        engine.model_name,
        config.device,
        config.dtype,
        "float" if config.quantization == "none" else config.quantization,
        num_adapters,
        "" if num_adapters == 1 else "s",
    )
    return engine
