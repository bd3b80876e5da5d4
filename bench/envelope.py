"""The result file every benchmark writes (DESIGN.md, "Benchmarks"):
`{"name", "device", "command", "date", "config": {...}, "metrics": {...}}`."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

import torch


def cpu_model() -> str:
    """Model name and the bf16 matmul features of this CPU, from /proc/cpuinfo."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    names = [line.split(":", 1)[1].strip() for line in info.splitlines() if "model name" in line]
    extra = [flag for flag in ("avx512_bf16", "amx_bf16") if f" {flag}" in info]
    return ", ".join([names[0] if names else platform.processor(), *extra])


def describe_device(device: str = "cpu") -> str:
    """The machine a benchmark ran on: the GPU's name, or the CPU, its cores and torch threads."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    cores = len(os.sched_getaffinity(0))
    return (
        f"cpu ({platform.machine()}, {cores} of {os.cpu_count()} cores: {cpu_model()}), "
        f"{torch.get_num_threads()} torch threads"
    )


def command_line(module: str, argv: list[str] | None = None) -> str:
    """`python -m bench.MODULE ARGS`, behind `nice -n N` when the run was reniced and behind the
    TOPPINGS_* variables set (they change what the servers build and run)."""
    args = sys.argv[1:] if argv is None else argv
    nice = f"nice -n {os.nice(0)} " if os.nice(0) else ""
    env = "".join(f"{k}={shlex.quote(v)} " for k, v in sorted(os.environ.items())
                  if k.startswith("TOPPINGS_"))  # fmt: skip
    return f"{env}{nice}python -m bench.{module} " + " ".join(args)


def write_result(
    out: str | Path,
    name: str,
    module: str,
    *,
    device: str,
    config: dict,
    metrics: dict,
    argv: list[str] | None = None,
) -> dict:
    """Write the result file of benchmark `name` (driver bench/`module`.py) to `out`; return it.

    `argv` is the driver's arguments (default: sys.argv[1:]); the date is UTC.
    """
    result = {
        "name": name,
        "device": device,
        "command": command_line(module, argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": config,
        "metrics": metrics,
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result
