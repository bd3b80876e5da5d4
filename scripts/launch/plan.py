"""What `toppings-launch` runs on the node: the servers' cores and GPUs, their command line, and
the checks every server would otherwise fail at start."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from toppings.scripts.launch.cli_args import LaunchConfig
from toppings.scripts.launch.procs import ServerProc
from toppings.server.settings import process_cores


def split_cores(cores: Sequence[int], num_sets: int) -> list[tuple[int, ...]]:
    """Split `cores` into `num_sets` disjoint contiguous sets whose sizes differ by at most one.

    Neighbouring core ids usually share a socket (and cache), so each set stays local.
    """
    cores = sorted(set(cores))
    if num_sets < 1:
        raise ValueError("need at least one set")
    if len(cores) < num_sets:
        raise ValueError(f"{len(cores)} cores cannot make {num_sets} disjoint non-empty sets")
    base, extra = divmod(len(cores), num_sets)
    sets, start = [], 0
    for i in range(num_sets):
        size = base + (1 if i < extra else 0)
        sets.append(tuple(cores[start : start + size]))
        start += size
    return sets


def plan_servers(args: LaunchConfig, log_dir: Path) -> list[ServerProc]:
    """The node's servers: one per GPU (or --num-servers), each on its own set of cores
    (raises ValueError when they cannot be placed)."""
    gpus = list(args.gpus or [])
    num = args.num_servers or len(gpus) or 1
    if args.device == "cuda" and not gpus:
        gpus = list(range(num))
    if args.device == "cuda" and len(gpus) != num:
        raise ValueError(f"{num} servers but {len(gpus)} GPUs")
    core_sets = split_cores(args.cores or sorted(process_cores()), num)
    num_device = args.device_cores_per_server
    smallest = min(len(s) for s in core_sets)
    if num_device and not 0 < num_device < smallest:
        raise ValueError(
            f"--device-cores-per-server {num_device} leaves no host core in the smallest core "
            f"set ({smallest} cores)"
        )
    if any(a in ("--device-cores", "--cpu-cores") or a.startswith(("--device-cores=",
           "--cpu-cores=")) for a in args.serve_args):  # fmt: skip
        raise ValueError(
            "--device-cores / --cpu-cores are the launcher's to give: use "
            "--device-cores-per-server N (each server's first N cores run its forward pass)"
        )
    workers = args.cpu_workers
    if workers is not None and not 0 <= workers <= smallest - num_device:
        raise ValueError(f"--cpu-workers {workers} does not fit the smallest core set")
    return [
        ServerProc(
            index=i,
            url=f"http://{args.host}:{args.base_port + i}",
            cores=cores,
            num_workers=len(cores) - num_device if workers is None else workers,
            gpu=gpus[i] if args.device == "cuda" else None,
            log_path=log_dir / f"server-{i}.log",
            device_cores=cores[:num_device],
        )
        for i, cores in enumerate(core_sets)
    ]


def check_inputs(args: LaunchConfig, servers: list[ServerProc]) -> None:
    """Refuse at once what every server would refuse at start (raises ValueError): a missing
    model, adapter or adapter folder, a port in use. toppings-serve checks the rest."""
    from toppings.gpu_lora.peft.config import AdapterError, read_adapter_config
    from toppings.server.http.listen import listen_problem

    if args.model != "smollm2":
        model = Path(args.model).expanduser()
        is_gguf = model.is_file() and model.suffix == ".gguf"
        if not is_gguf and not (model / "config.json").is_file():
            what = "does not exist" if not model.exists() else "is no checkpoint directory"
            raise ValueError(f"--model {args.model} {what} (expected a Hugging Face checkpoint "
                             "directory with config.json, a .gguf file or smollm2)")  # fmt: skip
    for spec in args.lora:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora: expected NAME=PATH, got {spec!r}")
        try:
            read_adapter_config(path)
        except AdapterError as e:
            raise ValueError(f"--lora {name}: {e}") from None
    for folder in args.lora_dir:
        if not Path(folder).is_dir():
            raise ValueError(f"--lora-dir {folder} is not a directory")
    if args.chat_template is not None:
        from toppings.server.chat_template.file import read_chat_template

        read_chat_template(args.chat_template)  # its ValueError names the flag
    ports = [("--base-port", s.port) for s in servers]
    if args.start_scheduler:
        ports.append(("--scheduler-port", args.scheduler_port))
    for flag, port in ports:
        if problem := listen_problem(args.host, port):
            raise ValueError(f"{flag}: {problem}")


def serve_command(args: LaunchConfig, server: ServerProc) -> list[str]:
    """The toppings-serve command line of one server (without the numactl prefix)."""
    cmd = [sys.executable, "-m", "toppings.server.cli", "--model", args.model,
           "--device", args.device, "--host", args.host, "--port", str(server.port),
           "--drain-timeout", str(args.drain_timeout), "--cpu-workers", str(server.num_workers),
           "--cpu-cores", ",".join(map(str, server.host_cores))]  # fmt: skip
    if server.device_cores:
        cmd += ["--device-cores", ",".join(map(str, server.device_cores))]
    for spec in args.lora:
        cmd += ["--lora", spec]
    for d in args.lora_dir:
        cmd += ["--lora-dir", str(d)]
    if args.chat_template is not None:
        cmd += ["--chat-template", str(Path(args.chat_template).expanduser().resolve())]
    return cmd + list(args.serve_args)


def numactl_usable(cores: tuple[int, ...]) -> bool:
    """numactl is installed and may bind here (containers often refuse set_mempolicy)."""
    if shutil.which("numactl") is None:
        return False
    probe = ["numactl", f"--physcpubind={cores[0]}", "--localalloc", "true"]
    return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
