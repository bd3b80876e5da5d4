"""`toppings-launch`'s command line, generated from settings classes (server.settings), as
toppings-serve's is: the node's servers, what they serve, the scheduler they join, and how they
are supervised. `LaunchConfig` is the four in one flat frozen dataclass (`config.num_servers`,
`config.max_restarts`, ...) plus the arguments after `--`, which go to every toppings-serve.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from toppings.server.settings import (
    Flag,
    Settings,
    command_parser,
    log_level,
    parse_cores,
    setting,
)


@dataclass(frozen=True)
class NodeSettings(Settings):
    """How many servers this node runs, on which devices and cores, at which ports."""

    title = "node"

    config: Path | None = setting(
        None,
        flag=Flag(
            "TOML file with the same keys as the flags (dashes or underscores: num_servers = 2, "
            'lora_dir = ["/loras"]), plus serve_args, the list of what would follow `--`; a '
            "flag given too wins, a repeatable one (--lora, --lora-dir) adds to the file's list",
            type=Path,
        ),
    )
    model: str | None = setting(None, flag=Flag("what toppings-serve --model takes"))
    device: str = setting(
        "cpu", choices=("cpu", "cuda"), flag=Flag("toppings-serve --device of every server")
    )
    num_servers: int | None = setting(None, flag=Flag("default: 1, or one per --gpus", type=int))
    gpus: tuple[int, ...] | None = setting(
        None, flag=Flag("GPU ids, one server each", type=parse_cores)
    )
    host: str = setting("127.0.0.1", flag=Flag("address the servers (and scheduler) listen on"))
    base_port: int = setting(8100, flag=Flag("server i listens on base + i", type=int))
    cores: tuple[int, ...] | None = setting(
        None, flag=Flag("default: this process's", type=parse_cores)
    )
    cpu_workers: int | None = setting(
        None, flag=Flag("per server; default: its (host) cores", type=int)
    )
    device_cores_per_server: int = setting(
        0,
        flag=Flag(
            "a device/host split inside each server's core set: its first N cores run the "
            "forward pass (toppings-serve --device-cores), the rest its CPU workers and adapter "
            "loader (--cpu-cores); 0: no split",
            type=int,
            metavar="N",
        ),
    )
    numactl: str = setting(
        "auto",
        choices=("auto", "never"),
        flag=Flag("bind each server with numactl where it works (auto), else sched_setaffinity"),
    )

    def check(self) -> None:
        if not self.model:
            raise ValueError("--model is required (flag or config file)")


@dataclass(frozen=True)
class ServedSettings(Settings):
    """What every server of the node serves, besides the arguments after `--`."""

    title = "served"

    lora: tuple[str, ...] = setting(
        (),
        flag=Flag(
            "toppings-serve --lora for every server (repeatable)",
            action="append",
            metavar="NAME=PATH",
            parse=tuple,
        ),
    )
    lora_dir: tuple[str, ...] = setting(
        (),
        flag=Flag(
            "toppings-serve --lora-dir for every server (repeatable)",
            action="append",
            metavar="DIR",
            parse=tuple,
        ),
    )
    chat_template: str | None = setting(
        None,
        flag=Flag(
            "toppings-serve --chat-template for every server: a Jinja chat template file used "
            "instead of the checkpoint's own",
            metavar="PATH",
        ),
    )


@dataclass(frozen=True)
class SchedulerLinkSettings(Settings):
    """The scheduler the servers are registered with: one that runs already, or one started
    here."""

    title = "scheduler"

    scheduler: str | None = setting(None, flag=Flag("register servers there", metavar="URL"))
    start_scheduler: bool = setting(
        False,
        flag=Flag(
            "also run toppings-scheduler here and register the servers with it",
            action="store_true",
        ),
    )
    scheduler_port: int = setting(8000, flag=Flag("the started scheduler's port", type=int))
    registry: Path | None = setting(
        None,
        flag=Flag("the started scheduler's SQLite registry (default: in the log dir)", type=Path),
    )
    scheduler_arg: tuple[str, ...] = setting(
        (),
        flag=Flag(
            "passed to the started scheduler, e.g. --scheduler-arg=--policy=random",
            action="append",
            metavar="ARG",
            parse=tuple,
        ),
    )

    def check(self) -> None:
        if self.start_scheduler and self.scheduler:
            raise ValueError("--scheduler URL and --start-scheduler exclude each other")


@dataclass(frozen=True)
class SupervisionSettings(Settings):
    """How long the launcher waits, when it restarts a server, where the logs go."""

    title = "supervision"

    drain_timeout: float = setting(
        30.0, flag=Flag("seconds a stopping server may take to finish its requests", type=float)
    )
    start_timeout: float = setting(600.0, flag=Flag("seconds to first /health", type=float))
    unhealthy_timeout: float = setting(
        60.0,
        flag=Flag(
            "restart a running server (or the started scheduler) whose /health has failed this "
            "long (0: never)",
            type=float,
        ),
    )
    max_restarts: int = setting(5, flag=Flag("per server", type=int))
    restart_backoff: float = setting(1.0, flag=Flag("first delay, doubling", type=float))
    log_dir: Path | None = setting(
        None,
        flag=Flag(
            "servers' and scheduler's logs (and the default registry), kept; default: a new "
            "temporary directory, removed after a clean stop, kept (and printed) if anything "
            "failed",
            type=Path,
        ),
    )
    log_level: str = setting("INFO", flag=Flag("DEBUG, INFO, WARNING or ERROR", type=log_level))


@dataclass(frozen=True)
class LaunchConfig(NodeSettings, ServedSettings, SchedulerLinkSettings, SupervisionSettings):
    """Every setting of one `toppings-launch`, flat; `serve_args` (no flag) is what followed
    `--` on the command line, after the config file's `serve_args`."""

    serve_args: tuple[str, ...] = ()


# Every settings class whose fields are flags of toppings-launch, in --help's order.
SETTINGS_CLASSES: tuple[type[Settings], ...] = (
    NodeSettings,
    ServedSettings,
    SchedulerLinkSettings,
    SupervisionSettings,
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of `toppings-launch` (docs/flags.md is generated from the same classes)."""
    return command_parser(
        "toppings-launch",
        "Start a node's inference servers on disjoint cores and keep them running.",
        SETTINGS_CLASSES,
        epilog="Arguments after `--` go to every toppings-serve unchanged.",
    )
