"""Helpers shared by more than one benchmark driver.

Layer shapes and an adapter record for the CPU LoRA benches (bench_cpu_lora_ipc,
bench_cpu_lora_parallel), the emulated link of the load benches (bench_cpu_assisted,
bench_single_server): its speed is set so that loading one adapter takes one prefill's time,
and PEFT adapters written from a model's shapes alone (for `--load-format dummy` models, which
have no weights for the peft library to wrap).
"""

from __future__ import annotations

import json
import socket
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

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
    """What HostRepository.add reads: {(layer, module): (A [R, H_in], B [H_out, R])}, under
    `id`."""

    id: int
    name: str
    rank: int
    scale: float
    weights: dict


def adapter_bytes(path: str | Path, model_dir: str, dtype: torch.dtype) -> int:
    """Bytes of one PEFT adapter's A and B in `dtype`, as the device cache counts them."""
    from toppings.gpu_lora.peft.adapter import load_peft_adapter
    from toppings.server.model.loader import load_checkpoint

    config = load_checkpoint(model_dir, "dummy").config  # shapes only: no weight is read
    return load_peft_adapter(str(path), config).bytes_at(dtype)


def free_port() -> int:
    """A loopback TCP port nothing listens on now (for a server a bench starts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def link_gbps_for(nbytes: int, seconds: float) -> float:
    """The link speed (Gbit/s) at which `nbytes` take `seconds` to move."""
    return nbytes * 8 / seconds / 1e9


def write_random_adapter(
    out_dir: str | Path,
    model_dir: str,
    rank: int,
    targets: tuple[str, ...],
    seed: int,
    config=None,
) -> Path:
    """A PEFT LoRA directory of `rank` on `targets` of every layer of the model at `model_dir`,
    drawn from its config.json alone (bfloat16, small values: outputs stay finite); returns it.
    `config`: that model's config when the caller has it already (reading it takes seconds, the
    adapter itself a fraction of one: a driver writing a thousand passes it).
    """
    from toppings.gpu_lora.peft.config import CONFIG_FILE, WEIGHTS_FILE, module_name
    from toppings.server.model.loader import load_checkpoint

    if config is None:
        config = load_checkpoint(model_dir, "dummy").config  # shapes only: no weight is drawn
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in targets:
            h_in, h_out = config.projection_shape(module)
            key = f"base_model.model.{module_name(layer, module)}"
            a = torch.randn(rank, h_in, generator=gen) / h_in**0.5  # [R, H_in]
            b = torch.randn(h_out, rank, generator=gen) / (8 * rank)  # [H_out, R]
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    save_file(tensors, str(out / WEIGHTS_FILE))
    (out / CONFIG_FILE).write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
        "bias": "none", "base_model_name_or_path": str(model_dir),
    }))  # fmt: skip
    return out


def prefill_ms(
    model_dir: str,
    dtype: str,
    prompt: list[int],
    device: str = "cpu",
    **config_fields,
) -> float:
    """Median time of a lone prefill of `prompt` (no adapter) on this machine. config_fields:
    more EngineConfig fields (the load format, the device/host split's cores). Each run's
    prompt differs in its first token: the same prompt again would hit the prefix cache and
    time only its last block (4.5x too fast for a 128-token prompt on one core)."""
    config = EngineConfig(device=device, dtype=dtype, max_total_tokens=4096, **config_fields)
    engine = build_engine(model_dir, config)
    try:
        params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        times = []
        for i in range(5):
            fresh = [prompt[0] + 1 + i, *prompt[1:]]
            out = engine.submit(GenerationRequest(fresh, params)).result()
            times.append(out.ttft_s)
        return 1000 * statistics.median(times[1:])
    finally:
        engine.shutdown()


def add_output_thread_flag(parser) -> None:
    """`--output-thread auto|on|off` of a bench that runs an engine (`output_thread_setting`)."""
    parser.add_argument(
        "--output-thread",
        choices=("auto", "on", "off"),
        default="auto",
        help="detokenizing and streaming on the output processor's thread (on) or inside each "
        "step on the engine thread (off); auto: the server's default (off on a cpu)",
    )


def output_thread_setting(choice: str) -> bool | None:
    """The engine's `output_thread` for an `--output-thread` choice (auto: None, the default)."""
    return {"on": True, "off": False}.get(choice)


def sse_events(url: str, path: str, body: dict, timeout_s: float = 600) -> Iterator[dict]:
    """POST a streamed request (`body` with "stream": true) to a server; its server-sent events,
    parsed, up to `[DONE]` (an error event raises RuntimeError with its message)."""
    import requests

    with requests.post(url + path, json=body, stream=True, timeout=timeout_s) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error'].get('message')}")
            yield event


def alternating(kinds: Sequence[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, kind) for `rounds` rounds over `kinds`, the order reversed every other round, so
    that no kind always runs first (on a warmer, or a more crowded, machine)."""
    for r in range(rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            yield r, kind


def medians(rounds: dict[str, list[dict]]) -> dict[str, dict]:
    """Per kind, the median of each key over its rounds (rows of numbers), and the rows."""
    return {kind: {**{key: statistics.median(row[key] for row in rows) for key in rows[0]},
                   "rounds": rows} for kind, rows in rounds.items()}  # fmt: skip
