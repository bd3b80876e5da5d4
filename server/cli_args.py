"""`toppings-serve`'s command line: its flags, their types and defaults (argparse).

`server.cli` builds the engine and the HTTP front end from what this parser returns; the launcher
(`scripts/launch/cli.py`) reuses the core-list and log-level types for its own flags.
"""

from __future__ import annotations

import argparse
import logging
import os

from toppings.gpu_lora.eviction import EVICTION_POLICIES
from toppings.server.api.frontend import DEFAULT_RESERVE_THREADS
from toppings.server.config import (
    DEVICES,
    DTYPE_CHOICES,
    KERNELS,
    LORA_MODES,
    MEMORY_LAYOUTS,
    QUEUE_POLICIES,
)
from toppings.server.memory.policies import MEMORY_POLICIES


def _lora(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {spec!r}")
    return name, path


def parse_cores(spec: str) -> tuple[int, ...]:
    """`0,2,4-7` -> (0, 2, 4, 5, 6, 7); the order is kept, duplicates are refused."""
    cores: list[int] = []
    try:
        for part in spec.split(","):
            lo, sep, hi = part.strip().partition("-")
            cores.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected cores like 0,2,4-7, got {spec!r}") from None
    if not cores or min(cores) < 0 or len(set(cores)) != len(cores):
        raise argparse.ArgumentTypeError(f"expected distinct non-negative cores, got {spec!r}")
    return tuple(cores)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def log_level(text: str) -> str:
    """A logging level name (DEBUG, INFO, ...), upper-cased; argparse refuses anything else."""
    level = text.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise argparse.ArgumentTypeError(f"expected DEBUG, INFO, WARNING or ERROR, got {text!r}")
    return level


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="toppings-serve",
        description="Serve one base model and many LoRA adapters over an OpenAI-compatible API.",
    )
    p.add_argument(
        "--model",
        required=True,
        help="Hugging Face checkpoint directory, .gguf file, or the alias smollm2",
    )
    p.add_argument(
        "--lora",
        action="append",
        type=_lora,
        default=[],
        metavar="NAME=PATH",
        help="a PEFT adapter directory served as model NAME (repeatable)",
    )
    p.add_argument(
        "--lora-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="serve every PEFT adapter directory under DIR, named after its folder; "
        "/v1/load_lora_adapter may load from DIR too (repeatable)",
    )
    p.add_argument(
        "--allowed-lora-root",
        action="append",
        default=[],
        metavar="DIR",
        help="/v1/load_lora_adapter may load adapters from under DIR (repeatable); with "
        "neither this nor --lora-dir, loading at run time is disabled",
    )
    p.add_argument(
        "--adapter-store",
        metavar="DIR",
        help="LoRAServe's adapter pool: adapters fetched from peer servers are written under DIR "
        "(/v1/load_lora_adapter with 'peers'); without it this server fetches nothing",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100, help="0 picks a free port")
    p.add_argument("--device", choices=DEVICES, default="cpu")
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="auto (default): bfloat16 on cuda; on a cpu, bfloat16 where it multiplies natively "
        "and the model's projections run faster in it (measured at start-up), else float32",
    )
    p.add_argument(
        "--lora-mode",
        choices=LORA_MODES,
        default="cached",
        help="how a request whose adapter is not on the device starts",
    )
    p.add_argument("--kernel", choices=KERNELS, default="mbgmv")
    p.add_argument(
        "--adapter-cache-bytes",
        type=int,
        default=0,
        metavar="N",
        help="device bytes for adapter weights (0: no limit); beyond it adapters are evicted",
    )
    p.add_argument("--eviction", choices=tuple(EVICTION_POLICIES), default="lru")
    p.add_argument(
        "--link-gbps",
        type=float,
        default=0.0,
        metavar="X",
        help="--device cpu only: throttle adapter loads to emulate a link of X GB/s (0: off)",
    )
    p.add_argument(
        "--cpu-workers",
        type=int,
        default=0,
        metavar="N",
        help="CPU worker processes for cpu-assisted LoRA (0: host LoRA runs in-process)",
    )
    p.add_argument(
        "--cpu-cores",
        type=parse_cores,
        default=(),
        metavar="LIST",
        help="cores the CPU workers are pinned to, one each, e.g. 4,5,6 or 4-6",
    )
    p.add_argument(
        "--cpu-spin-us",
        type=float,
        default=0.0,
        metavar="US",
        help="the engine and the CPU workers spin up to US microseconds on their semaphores "
        "before sleeping: cuts a layer call's overhead when the engine thread and every worker "
        "have a core of their own (e.g. 5000 on a GPU node); leave 0 when they share cores",
    )
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=32768,
        help="KV cache size in tokens over all requests (the pool's default budget: see "
        "--memory-bytes)",
    )
    p.add_argument(
        "--memory-layout",
        choices=MEMORY_LAYOUTS,
        default="pool",
        help="pool: one memory budget for KV blocks and adapters, which live in what KV does "
        "not use (ELORA/FastLibra); static: the old split, --max-total-tokens of KV and "
        "--adapter-cache-bytes of adapters",
    )
    p.add_argument(
        "--memory-bytes",
        type=int,
        default=0,
        metavar="N",
        help="the pool's budget (0: 40%% of the free device memory on cuda; on a cpu "
        "--max-total-tokens of KV plus --adapter-cache-bytes, adapters unlimited when that is 0)",
    )
    p.add_argument(
        "--prefix-cache",
        choices=("on", "off"),
        default="on",
        help="reuse cached KV of a prompt's prefix, under the request's own adapter only",
    )
    p.add_argument(
        "--cuda-graphs",
        choices=("on", "off"),
        default=None,
        help="decode steps replay CUDA graphs captured per batch-size bucket (default: on with "
        "--device cuda; refused with --device cpu)",
    )
    p.add_argument(
        "--host-memory-bytes",
        type=int,
        default=0,
        metavar="N",
        help="host tier for KV blocks leaving the device (swapped back in on a hit when that "
        "beats recomputing them; --link-gbps throttles it on a cpu); 0: they are dropped",
    )
    p.add_argument(
        "--memory-policy",
        choices=tuple(MEMORY_POLICIES),
        default="fastlibra",
        help="what leaves the pool first: fastlibra's cost model, or lru",
    )
    p.add_argument("--block-tokens", type=_positive, default=16, metavar="N",
                   help="tokens per KV block")  # fmt: skip
    p.add_argument("--max-batch-size", type=int, default=128)
    p.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        metavar="N",
        help="OpenMP threads of the engine's compute (0: torch's default, every core); leave "
        "cores to --cpu-workers on a CPU-only node",
    )
    p.add_argument(
        "--queue-policy",
        choices=QUEUE_POLICIES,
        default="fcfs",
        help="which waiting request is admitted next: fcfs, or chameleon's adapter-aware "
        "multi-level queues with token quotas",
    )
    p.add_argument("--ttft-slo-ms", type=float, default=5000.0, metavar="X",
                   help="the TTFT SLO that chameleon's queue quotas are sized for")  # fmt: skip
    p.add_argument(
        "--max-concurrent-requests",
        type=_positive,
        default=None,
        metavar="N",
        help="generation requests in flight (running or queued) past which a request gets 429 "
        "with Retry-After; waitress runs a thread for each (default: 4x --max-batch-size)",
    )
    p.add_argument(
        "--threads",
        type=_positive,
        default=DEFAULT_RESERVE_THREADS,
        metavar="N",
        help="waitress threads beyond --max-concurrent-requests, kept for /health, /stats, "
        "/metrics, adapter load/unload and quick 429s",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("TOPPINGS_API_KEY") or None,
        help="require Authorization: Bearer KEY on every endpoint but /health "
        "(default: $TOPPINGS_API_KEY; prefer the variable, argv is visible to all users)",
    )
    p.add_argument("--max-prompt-tokens", type=_positive, default=None, metavar="N")
    p.add_argument(
        "--max-new-tokens-limit",
        type=_positive,
        default=None,
        metavar="N",
        help="largest max_tokens a request may ask for (a default max_tokens is cut to it)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM, how long requests in flight may take to finish",
    )
    p.add_argument("--log-level", type=log_level, default="INFO")
    return p
