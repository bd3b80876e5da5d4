"""Helpers shared by more than one benchmark driver.

Layer shapes and an adapter record for the CPU LoRA benches (bench_cpu_lora_ipc,
bench_cpu_lora_parallel), and the emulated link of the load benches (bench_cpu_assisted,
bench_single_server): its speed is set so that loading one adapter takes one prefill's time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from toppings.server.config import EngineConfig
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.runtime import build_engine

QKV = ("q_proj", "k_proj", "v_proj")


@dataclass(frozen=True)
class Shapes:
    """The projection shapes of a Llama-2-7B layer (one layer is enough here)."""

    hidden: int = 4096
    intermediate: int = 11008
    num_layers: int = 1

    def projection_shape(self, module: str) -> tuple[int, int]:
        h, i = self.hidden, self.intermediate
        return {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}.get(module, (h, h))


@dataclass(frozen=True)
class Adapter:
    """What HostRepository.add reads: {(layer, module): (A [R, H_in], B [H_out, R])}."""

    name: str
    rank: int
    scale: float
    weights: dict


def adapter_bytes(path: str | Path, model_dir: str, dtype: torch.dtype) -> int:
    """Bytes of one PEFT adapter's A and B in `dtype`, as the device cache counts them."""
    from toppings.gpu_lora.peft_format import load_peft_adapter
    from toppings.server.model.loader import load_checkpoint

    config = load_checkpoint(model_dir).config
    return load_peft_adapter(str(path), config).bytes_at(dtype)


def link_gbps_for(nbytes: int, seconds: float) -> float:
    """The link speed (Gbit/s) at which `nbytes` take `seconds` to move."""
    return nbytes * 8 / seconds / 1e9


def prefill_ms(model_dir: str, dtype: str, prompt: list[int], device: str = "cpu") -> float:
    """Median time of a lone 128-token prefill (no adapter) on this machine."""
    config = EngineConfig(device=device, dtype=dtype, max_total_tokens=4096)
    engine = build_engine(model_dir, config)
    try:
        params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        times = []
        for _ in range(5):
            out = engine.submit(GenerationRequest(prompt, params)).result()
            times.append(out.ttft_s)
        return 1000 * statistics.median(times[1:])
    finally:
        engine.shutdown()
