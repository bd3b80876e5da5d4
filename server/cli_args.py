"""`toppings-serve`'s command line, generated from the settings classes (server.settings).

One argparse group per class: the command's own `ServeConfig` (model, adapters, listening,
draining, logging), the HTTP layer's `ApiOptions`, and the four parts of `EngineConfig`.
`parse_configs` builds the three objects from what argparse returned; each is validated as it
is built, before anything loads (a `--chat-template` file is read and compiled there too). The
launcher (`scripts/launch/cli.py`) reuses the core-list and log-level types for its own flags.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from toppings.server.api.options import ApiOptions
from toppings.server.chat_template.file import read_chat_template
from toppings.server.config import ENGINE_PARTS, EngineConfig
from toppings.server.http.frontend import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_RESERVE_THREADS
from toppings.server.settings import (
    Bound,
    Flag,
    Settings,
    add_flags,
    build,
    log_level,
    name_path,
    parse_cores,
    positive,
    setting,
)

__all__ = [
    "SETTINGS_CLASSES", "ServeConfig", "build_parser", "log_level", "parse_configs", "parse_cores",
]  # fmt: skip


@dataclass(frozen=True)
class ServeConfig(Settings):
    """What to serve, where to listen, how to stop."""

    title = "server"

    model: str = setting(
        flag=Flag("Hugging Face checkpoint directory, .gguf file, or the alias smollm2")
    )
    loras: tuple[tuple[str, str], ...] = setting(
        (),
        flag=Flag(
            "a PEFT adapter directory served as model NAME (repeatable)",
            name="--lora",
            type=name_path,
            metavar="NAME=PATH",
            action="append",
            parse=tuple,
        ),
    )
    lora_dirs: tuple[str, ...] = setting(
        (),
        flag=Flag(
            "serve every PEFT adapter directory under DIR, named after its folder; "
            "/v1/load_lora_adapter may load from DIR too (repeatable)",
            name="--lora-dir",
            metavar="DIR",
            action="append",
            parse=tuple,
        ),
    )
    allowed_lora_roots: tuple[str, ...] = setting(
        (),
        flag=Flag(
            "/v1/load_lora_adapter may load adapters from under DIR (repeatable); with "
            "neither this nor --lora-dir, loading at run time is disabled",
            name="--allowed-lora-root",
            metavar="DIR",
            action="append",
            parse=tuple,
        ),
    )
    chat_template: str | None = setting(
        None,
        flag=Flag(
            "a Jinja chat template file used instead of the checkpoint's own (e.g. one that "
            "renders tools or a system role); a regular file of at most 1 MiB (nothing under "
            "/proc, /sys or /dev, no link out of its directory), checked before the model loads",
            metavar="PATH",
        ),
    )
    host: str = setting("127.0.0.1", flag=Flag())
    port: int = setting(8100, flag=Flag("0 picks a free port", type=int))
    threads: int = setting(
        DEFAULT_RESERVE_THREADS,
        bound=Bound.POSITIVE,
        flag=Flag(
            "waitress threads beyond --max-concurrent-requests, kept for /health, /stats, "
            "/metrics, adapter load/unload and quick 429s",
            type=positive,
            metavar="N",
        ),
    )
    header_timeout: int = setting(
        DEFAULT_HEADER_TIMEOUT_S,
        bound=Bound.POSITIVE,
        flag=Flag(
            "a connection whose request headers are not complete S seconds after they began (or "
            "that sends nothing for S seconds with no request running) is closed; at the "
            "connection limit the longest-waiting incomplete header is closed to make room",
            type=positive,
            metavar="S",
        ),
    )
    drain_timeout: float = setting(
        30.0,
        bound=Bound.NON_NEGATIVE,
        flag=Flag(
            "on SIGTERM, how long requests in flight may take to finish", type=float, metavar="S"
        ),
    )
    log_level: str = setting("INFO", flag=Flag(type=log_level))


# Every settings class whose fields are flags of toppings-serve, in --help's order (the flag
# reference, docs/flags.md, is generated from them: toppings.scripts.flag_reference).
SETTINGS_CLASSES: tuple[type[Settings], ...] = (ServeConfig, ApiOptions, *ENGINE_PARTS)


def build_parser() -> argparse.ArgumentParser:
    """The parser of `toppings-serve`: every flag of every settings class, grouped by class."""
    parser = argparse.ArgumentParser(
        prog="toppings-serve",
        description="Serve one base model and many LoRA adapters over an OpenAI-compatible API.",
    )
    for cls in SETTINGS_CLASSES:
        add_flags(parser, cls)
    return parser


def parse_configs(args: argparse.Namespace) -> tuple[ServeConfig, EngineConfig, ApiOptions]:
    """The command's, the engine's and the HTTP layer's settings from the parsed flags; raises
    ValueError naming the first field out of its range."""
    serve = build(ServeConfig, args)
    engine = build(EngineConfig, args)
    template = None if serve.chat_template is None else read_chat_template(serve.chat_template)
    options = build(ApiOptions, args, lora_roots=serve.lora_dirs + serve.allowed_lora_roots,
                    chat_template=template)  # fmt: skip
    return serve, engine, options
